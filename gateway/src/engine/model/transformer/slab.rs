//! Decode steps on a GPU with every running sequence's keys and values in
//! one array per layer, a slab: `[rows, kv_heads, columns, head_dim]`, each
//! row right-aligned so that all rows write this step's position into the
//! same column. A step is then the same few graph nodes per layer for 1 or
//! 128 sequences (one RoPE with a position per row, one write, one masked
//! attention), where attending row by row costs nodes, and on a GPU kernel
//! launches, in proportion to the batch. Rows whose sequence left the batch
//! become holes (computed, masked, ignored) until a newcomer takes them.
//!
//! The CPU keeps its native decode step; `MLXGATE_DECODE_SLAB=1` turns this
//! path on there too (tests check it against decoding alone).

use std::rc::Rc;

use mlx_rs::Array;
use mlx_rs::fast::{ScaledDotProductAttentionMask, rms_norm, scaled_dot_product_attention};
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::{add, concatenate, zeros_dtype};

use super::{Transformer, token_ids};
use crate::engine::lora::{self, AdapterStack, Projection};
use crate::engine::model::kv_cache::{KvCache, SlabArrays, SlabRow};
use crate::engine::model::weights::MlxResult;

/// Spare columns a slab is made or grown with, so most steps write in place.
const SPARE_COLUMNS: usize = 256;
/// Attention's key length is a multiple of this (see `slab_step`).
const KEY_BUCKET: usize = 128;
/// Leading columns every row has left behind, past which they are cut off.
const COMPACT_AFTER: usize = 512;

/// The batch's slab between steps.
pub(super) struct DecodeSlab {
    arrays: Rc<SlabArrays>,
    /// Columns each layer's arrays hold; the first `end` are in use.
    capacity: usize,
    end: usize,
    /// Each row's first column (its sequence's position 0); `None` for a
    /// hole. A row in use ends at `end`.
    rows: Vec<Option<usize>>,
}

/// Whether decode steps go through a slab: on a GPU, or when asked.
pub(super) fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        crate::mlx::Backend::detect() != crate::mlx::Backend::Cpu
            || std::env::var("MLXGATE_DECODE_SLAB").is_ok_and(|v| v == "1")
    })
}

impl Transformer {
    /// One decode step of `tokens` (one per cache) through the slab; float32
    /// logits `[B * vocab]` in the callers' order. A failed step drops the
    /// slab (the caches keep their rows of the last good one).
    pub(super) fn decode_in_slab(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
    ) -> MlxResult<Vec<f32>> {
        let mut held = self
            .slab
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = self.slab_step(&mut held, tokens, caches, adapters);
        if result.is_err() {
            *held = None;
        }
        result
    }

    fn slab_step(
        &self,
        held: &mut Option<DecodeSlab>,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
    ) -> MlxResult<Vec<f32>> {
        let rows_of = self.place(held, caches)?;
        let slab = held.as_mut().expect("placed");
        if slab.end >= slab.capacity {
            self.grow(slab)?;
        }
        let (width, end) = (slab.rows.len(), slab.end);
        // Per slab row: its token, position and adapters (holes: 0, 0, none).
        let none = AdapterStack::new();
        let mut row_tokens = vec![0u32; width];
        let mut offsets = vec![0i32; width];
        let mut row_adapters: Vec<&AdapterStack> = vec![&none; width];
        for (b, &row) in rows_of.iter().enumerate() {
            row_tokens[row] = tokens[b];
            offsets[row] = caches[b].offset as i32;
            row_adapters[row] = adapters[b];
        }
        // Attention reads the columns in use rounded up to a multiple of
        // KEY_BUCKET, so its shape, and with it MLX's cached CUDA graphs and
        // attention plans, changes once in KEY_BUCKET steps, not every step.
        let span = (end + 1).next_multiple_of(KEY_BUCKET).min(slab.capacity);
        // Row r attends to its columns start..=end; a hole to column `end`
        // alone (its output is ignored; a row with nothing would give NaN).
        let mut valid = vec![false; width * span];
        for (row, start) in slab.rows.iter().enumerate() {
            let from = start.unwrap_or(end);
            valid[row * span + from..=row * span + end].fill(true);
        }
        let mask = Array::from_slice(&valid, &[width as i32, 1, 1, span as i32]);
        let offsets = Array::from_slice(&offsets, &[width as i32]);
        let inputs: Vec<[u32; 1]> = row_tokens.iter().map(|&t| [t]).collect();
        let sequences: Vec<&[u32]> = inputs.iter().map(|t| t.as_slice()).collect();

        let c = &self.config;
        let (rows, heads, kv_heads, head_dim) = (
            width as i32,
            c.heads as i32,
            c.kv_heads as i32,
            c.head_dim as i32,
        );
        let eps = c.rms_norm_eps;
        let mut x = self.embed_ids(&token_ids(&sequences))?;
        let mut layers = Vec::with_capacity(self.blocks.len());
        for (index, block) in self.blocks.iter().enumerate() {
            let normed = rms_norm(&x, Some(&block.input_norm), eps)?;
            let a = &block.attention;
            let project = |linear: &super::Linear, projection, x: &Array| {
                lora::apply(linear.forward(x)?, x, index, projection, &row_adapters)
            };
            let split = |y: Array, n: i32, norm: &Option<Array>| -> MlxResult<Array> {
                let mut y = y.reshape(&[rows, 1, n, head_dim])?;
                if let Some(norm) = norm {
                    y = rms_norm(&y, Some(norm), eps)?;
                }
                y.transpose_axes(&[0, 2, 1, 3])
            };
            let q = split(
                project(&a.q_proj, Projection::Q, &normed)?,
                heads,
                &a.q_norm,
            )?;
            let k = split(
                project(&a.k_proj, Projection::K, &normed)?,
                kv_heads,
                &a.k_norm,
            )?;
            let v = split(project(&a.v_proj, Projection::V, &normed)?, kv_heads, &None)?;
            let q = block.rotate_rows(&q, c, &offsets)?;
            let k = block.rotate_rows(&k, c, &offsets)?;
            let (all_keys, all_values) = &slab.arrays.layers[index];
            let keys = written(all_keys, &k, 0, end)?;
            let values = written(all_values, &v, 0, end)?;
            let used = 0..span as i32;
            let attended = scaled_dot_product_attention(
                &q,
                keys.index((.., .., used.clone(), ..)),
                values.index((.., .., used, ..)),
                c.attention_scale(),
                Some(ScaledDotProductAttentionMask::Array(&mask)),
                None,
            )?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[rows, 1, heads * head_dim])?;
            let mut attended = project(&a.o_proj, Projection::O, &attended)?;
            if let Some(norm) = &block.post_attention_norm {
                attended = rms_norm(&attended, Some(norm), eps)?;
            }
            x = add(&x, &attended)?;
            let normed = rms_norm(&x, Some(&block.pre_mlp_norm), eps)?;
            let mut mlp = self.mlp(&block.mlp, index, &normed, &row_adapters)?;
            if let Some(norm) = &block.post_mlp_norm {
                mlp = rms_norm(&mlp, Some(norm), eps)?;
            }
            x = add(&x, &mlp)?;
            layers.push((keys, values));
        }
        let order: Vec<u32> = rows_of.iter().map(|&r| r as u32).collect();
        let last = x.index((.., 0, ..));
        let last = last.take_axis(Array::from_slice(&order, &[order.len() as i32]), 0)?;
        let logits = self.logits_of_hidden(&rms_norm(&last, Some(&self.final_norm), eps)?)?;
        mlx_rs::transforms::eval(
            std::iter::once(&logits).chain(layers.iter().flat_map(|(k, v)| [k, v])),
        )?;
        let out = logits.as_slice::<f32>().to_vec();

        slab.arrays = Rc::new(SlabArrays { layers });
        slab.end += 1;
        for (b, cache) in caches.iter_mut().enumerate() {
            let row = rows_of[b];
            clear_layers(cache);
            cache.offset += 1;
            cache.slab = Some(SlabRow {
                slab: slab.arrays.clone(),
                row,
                start: slab.rows[row].expect("a batch row is in use"),
                end: slab.end,
            });
        }
        Ok(out)
    }

    /// The slab row of each cache: where it already is, else a hole that
    /// its positions are copied into (right-aligned). The slab changes by a
    /// node or two per layer, never row by row: rows no cache claims become
    /// holes; too many holes are dropped; a newcomer longer than the rows in
    /// use shifts them right; missing rows are added blank; columns every
    /// row has left behind are cut off.
    fn place(
        &self,
        held: &mut Option<DecodeSlab>,
        caches: &mut [&mut KvCache],
    ) -> MlxResult<Vec<usize>> {
        let mut rows_of: Vec<Option<usize>> = vec![None; caches.len()];
        if let Some(slab) = held.as_mut() {
            let mut claimed = vec![false; slab.rows.len()];
            for (b, cache) in caches.iter().enumerate() {
                let Some(at) = &cache.slab else { continue };
                let here = Rc::ptr_eq(&at.slab, &slab.arrays)
                    && at.end == slab.end
                    && slab.rows[at.row] == Some(at.start)
                    && !claimed[at.row];
                if here {
                    claimed[at.row] = true;
                    rows_of[b] = Some(at.row);
                }
            }
            for (row, claimed) in claimed.into_iter().enumerate() {
                if !claimed {
                    slab.rows[row] = None;
                }
            }
        }
        let newcomers: Vec<usize> = (0..caches.len())
            .filter(|&b| rows_of[b].is_none())
            .collect();
        for &b in &newcomers {
            caches[b].settle();
        }
        let longest = newcomers
            .iter()
            .map(|&b| caches[b].offset)
            .max()
            .unwrap_or(0);
        let slab = match held {
            Some(slab) => slab,
            None => held.insert(self.blank_slab(longest)?),
        };
        let mut layers: Vec<(Array, Array)> = slab.arrays.layers.clone();
        let each = |layers: &mut Vec<(Array, Array)>, f: &dyn Fn(&Array) -> MlxResult<Array>| {
            layers.iter_mut().try_for_each(|(k, v)| -> MlxResult<()> {
                *k = f(k)?;
                *v = f(v)?;
                Ok(())
            })
        };
        // Holes beyond what the newcomers need waste each step's work.
        let needed = caches.len().max(4);
        if slab.rows.len() > 2 * needed {
            let keep: Vec<usize> = (0..slab.rows.len())
                .filter(|&r| slab.rows[r].is_some())
                .collect();
            let index = Array::from_slice(
                &keep.iter().map(|&r| r as u32).collect::<Vec<_>>(),
                &[keep.len() as i32],
            );
            each(&mut layers, &|a| a.take_axis(&index, 0))?;
            let renumber: Vec<Option<usize>> = {
                let mut map = vec![None; slab.rows.len()];
                for (new, &old) in keep.iter().enumerate() {
                    map[old] = Some(new);
                }
                map
            };
            for row in rows_of.iter_mut().flatten() {
                *row = renumber[*row].expect("a claimed row is kept");
            }
            slab.rows = keep.iter().map(|&r| slab.rows[r]).collect();
        }
        if longest > slab.end {
            let shift = longest - slab.end;
            each(&mut layers, &|a| {
                let mut shape = a.shape().to_vec();
                shape[2] = shift as i32;
                concatenate(&[zeros_dtype(&shape, a.dtype())?, a.clone()], 2)
            })?;
            slab.end += shift;
            slab.capacity += shift;
            for start in slab.rows.iter_mut().flatten() {
                *start += shift;
            }
        }
        let holes = slab.rows.iter().filter(|r| r.is_none()).count();
        if holes < newcomers.len() {
            let more = newcomers.len() - holes;
            each(&mut layers, &|a| {
                let mut shape = a.shape().to_vec();
                shape[0] = more as i32;
                concatenate(&[a.clone(), zeros_dtype(&shape, a.dtype())?], 0)
            })?;
            slab.rows.extend(std::iter::repeat_n(None, more));
        }
        let dtype = super::super::compute_dtype();
        for &b in &newcomers {
            let hole = slab
                .rows
                .iter()
                .position(Option::is_none)
                .expect("made room");
            let length = caches[b].offset;
            let start = slab.end - length;
            if length > 0 {
                for (layer, (keys, values)) in caches[b].layers.iter().zip(layers.iter_mut()) {
                    let (k, v) = layer
                        .mlx_arrays()?
                        .expect("a settled cache holds its positions");
                    *keys = written(keys, &k.as_dtype(dtype)?, hole, start)?;
                    *values = written(values, &v.as_dtype(dtype)?, hole, start)?;
                }
            }
            slab.rows[hole] = Some(start);
            rows_of[b] = Some(hole);
        }
        let first = slab
            .rows
            .iter()
            .flatten()
            .min()
            .copied()
            .unwrap_or(slab.end);
        if first >= COMPACT_AFTER {
            let cut = first as i32;
            each(&mut layers, &|a| Ok(a.index((.., .., cut.., ..))))?;
            slab.end -= first;
            slab.capacity -= first;
            for start in slab.rows.iter_mut().flatten() {
                *start -= first;
            }
        }
        slab.arrays = Rc::new(SlabArrays { layers });
        Ok(rows_of.into_iter().map(|r| r.expect("placed")).collect())
    }

    /// An empty slab (no rows) `end` columns in use and room to grow.
    fn blank_slab(&self, end: usize) -> MlxResult<DecodeSlab> {
        let c = &self.config;
        let dtype = super::super::compute_dtype();
        let capacity = end + SPARE_COLUMNS;
        let shape = [0, c.kv_heads as i32, capacity as i32, c.head_dim as i32];
        let layers = (0..self.blocks.len())
            .map(|_| Ok((zeros_dtype(&shape, dtype)?, zeros_dtype(&shape, dtype)?)))
            .collect::<MlxResult<Vec<_>>>()?;
        Ok(DecodeSlab {
            arrays: Rc::new(SlabArrays { layers }),
            capacity,
            end,
            rows: Vec::new(),
        })
    }

    /// More columns at the end of every layer's arrays.
    fn grow(&self, slab: &mut DecodeSlab) -> MlxResult<()> {
        let mut layers = Vec::with_capacity(slab.arrays.layers.len());
        for (keys, values) in &slab.arrays.layers {
            let mut shape = keys.shape().to_vec();
            shape[2] = SPARE_COLUMNS as i32;
            let spare = zeros_dtype(&shape, keys.dtype())?;
            layers.push((
                concatenate(&[keys.clone(), spare.clone()], 2)?,
                concatenate(&[values.clone(), spare], 2)?,
            ));
        }
        slab.capacity += SPARE_COLUMNS;
        slab.arrays = Rc::new(SlabArrays { layers });
        Ok(())
    }
}

/// `all` (`[rows, heads, columns, dim]`) with `part` written in from `row`
/// and `column` on: one slice update (the result is a new array; `all`,
/// which caches may still read, is unchanged).
fn written(all: &Array, part: &Array, row: usize, column: usize) -> MlxResult<Array> {
    let (row, column) = (row as i32, column as i32);
    let (rows, columns) = (part.shape()[0], part.shape()[2]);
    let mut all = all.clone();
    all.try_index_mut((row..row + rows, .., column..column + columns, ..), part)?;
    Ok(all)
}

/// A cache whose positions now live in the slab drops its own arrays (only
/// once the step succeeded: until then they are what it has).
fn clear_layers(cache: &mut KvCache) {
    for layer in &mut cache.layers {
        layer.keys = None;
        layer.values = None;
    }
}
