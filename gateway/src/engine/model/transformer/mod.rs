//! The decoder forward pass shared by llama, qwen2/3 and gemma3, on MLX ops.
//!
//! Batching: a step takes B sequences of the same length L. The projections
//! and MLP run on the whole `[B, L, hidden]` batch (one matmul per weight),
//! as does RoPE (each row at its own position); attention runs per sequence,
//! since each has its own cache length (prompts with nothing cached may
//! attend together under one mask, opt-in: `fresh`).

use mlx_rs::error::Exception;
use mlx_rs::fast::{rms_norm, rope};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{add, concatenate, multiply, zeros_dtype};
use mlx_rs::{Array, Dtype};

mod fresh;
mod native;
mod sharded;
mod slab;

use std::sync::OnceLock;

use super::LoadError;
use super::config::{Family, ModelConfig};
use super::kv_cache::KvCache;
use super::weights::{Embedding, Kernel, Linear, MlxResult, WeightMap};
use crate::engine::distributed::lockstep;
use crate::engine::lora::{self, AdapterStack, Projection, Targets};
use crate::mlx::attention::{Mask, attention};
use crate::mlx::compiled;
use crate::mlx::kernels::{self, KernelChoice};
use fresh::FreshRows;
use native::NativeDecoder;

/// What a projection's output goes through: `residual(y, x, layer,
/// projection)`, `y` its base output and `x` its input. Inference adds the
/// rows' LoRA adapters ([`lora::residual_of`]); training, deltas autograd can
/// differentiate.
type Residual<'a> = &'a dyn Fn(Array, &Array, usize, Projection) -> MlxResult<Array>;

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// On a GPU, q, k and v in one matmul (the three above are then views
    /// of its rows): see [`Block::stack_projections`].
    qkv: Option<Linear>,
    /// Qwen3 / Gemma3 normalise queries and keys per head before RoPE.
    q_norm: Option<Array>,
    k_norm: Option<Array>,
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    /// On a GPU, gate and up in one matmul, as `qkv`.
    gate_up: Option<Linear>,
}

struct Block {
    input_norm: Array,
    attention: Attention,
    /// Gemma3: norm of the attention output before the residual add.
    post_attention_norm: Option<Array>,
    /// Norm before the MLP (llama's `post_attention_layernorm`).
    pre_mlp_norm: Array,
    mlp: Mlp,
    /// Gemma3: norm of the MLP output before the residual add.
    post_mlp_norm: Option<Array>,
    sliding_window: Option<usize>,
    rope_theta: f32,
    /// Gemma 3 scales RoPE (linear, 4B and larger) on its global layers only;
    /// its local layers keep plain `rope_local_theta`.
    rope_scale: f32,
}

impl Attention {
    /// The attention weights of the layer named `p`, with per-head query and
    /// key norms where the family has them (Qwen3, Gemma 3).
    fn load(weights: &mut WeightMap, c: &ModelConfig, p: &str) -> Result<Attention, LoadError> {
        let (h, q_dim, kv_dim) = (c.hidden_size, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let has_qk_norm = matches!(c.family, Family::Qwen3 | Family::Gemma3);
        let qk_norm = |weights: &mut WeightMap, which: &str| -> Result<Option<Array>, LoadError> {
            if has_qk_norm {
                Ok(Some(weights.vector(
                    &format!("{p}.self_attn.{which}.weight"),
                    c.head_dim,
                    c.norm_weight_offset,
                )?))
            } else {
                Ok(None)
            }
        };
        Ok(Attention {
            q_proj: weights.linear(&format!("{p}.self_attn.q_proj"), q_dim, h)?,
            k_proj: weights.linear(&format!("{p}.self_attn.k_proj"), kv_dim, h)?,
            v_proj: weights.linear(&format!("{p}.self_attn.v_proj"), kv_dim, h)?,
            o_proj: weights.linear(&format!("{p}.self_attn.o_proj"), h, q_dim)?,
            qkv: None,
            q_norm: qk_norm(weights, "q_norm")?,
            k_norm: qk_norm(weights, "k_norm")?,
        })
    }

    /// The output projection of the heads' concatenated outputs `merged`.
    fn output(&self, merged: &Array, layer: usize, residual: Residual) -> MlxResult<Array> {
        residual(self.o_proj.forward(merged)?, merged, layer, Projection::O)
    }

    /// Queries, keys and values of `x` (`[B, L, hidden]`), each `[B, heads,
    /// L, head_dim]` (keys and values with `kv_heads`), normed per head
    /// where the family does, not yet rotated.
    fn project(
        &self,
        x: &Array,
        layer: usize,
        residual: Residual,
        c: &ModelConfig,
    ) -> MlxResult<(Array, Array, Array)> {
        let (batch, length) = (x.shape()[0], x.shape()[1]);
        let (heads, kv_heads, head_dim) = (c.heads as i32, c.kv_heads as i32, c.head_dim as i32);
        let (q, k, v) = match &self.qkv {
            Some(qkv) => {
                let y = qkv.forward(x)?;
                let (q_end, k_end) = (heads * head_dim, (heads + kv_heads) * head_dim);
                (
                    y.index((.., .., ..q_end)),
                    y.index((.., .., q_end..k_end)),
                    y.index((.., .., k_end..)),
                )
            }
            None => (
                self.q_proj.forward(x)?,
                self.k_proj.forward(x)?,
                self.v_proj.forward(x)?,
            ),
        };
        // [B, L, heads * head_dim] -> [B, heads, L, head_dim]
        let split = |y: Array, projection, n: i32, norm: &Option<Array>| -> MlxResult<Array> {
            let y = residual(y, x, layer, projection)?;
            let mut y = y.reshape(&[batch, length, n, head_dim])?;
            if let Some(norm) = norm {
                y = rms_norm(&y, Some(norm), c.rms_norm_eps)?;
            }
            y.transpose_axes(&[0, 2, 1, 3])
        };
        Ok((
            split(q, Projection::Q, heads, &self.q_norm)?,
            split(k, Projection::K, kv_heads, &self.k_norm)?,
            split(v, Projection::V, kv_heads, &None)?,
        ))
    }
}

impl Mlp {
    /// The MLP weights of the layer named `p`.
    fn load(weights: &mut WeightMap, c: &ModelConfig, p: &str) -> Result<Mlp, LoadError> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Mlp {
            gate_proj: weights.linear(&format!("{p}.mlp.gate_proj"), i, h)?,
            up_proj: weights.linear(&format!("{p}.mlp.up_proj"), i, h)?,
            down_proj: weights.linear(&format!("{p}.mlp.down_proj"), h, i)?,
            gate_up: None,
        })
    }

    /// Gate and up stacked, dense and without bias, for a family whose
    /// activation is SiLU: the weight [`kernels::decode_gated_matmul`]
    /// multiplies in one launch where the decode matmul takes a step's rows.
    fn gated_weight(&self, family: Family) -> Option<&Array> {
        match &self.gate_up {
            Some(Linear {
                kernel: Kernel::Dense(weight),
                bias: None,
            }) if family != Family::Gemma3 => Some(weight),
            _ => None,
        }
    }

    /// The MLP of `x` (`[B, L, hidden]`): `down(act(gate(x)) * up(x))`.
    fn forward(
        &self,
        x: &Array,
        (layer, family): (usize, Family),
        residual: Residual,
        gradients: Gradients,
    ) -> MlxResult<Array> {
        let (gate, up) = match &self.gate_up {
            Some(gate_up) => {
                let y = gate_up.forward(x)?;
                let middle = y.shape()[2] / 2;
                (y.index((.., .., ..middle)), y.index((.., .., middle..)))
            }
            None => (self.gate_proj.forward(x)?, self.up_proj.forward(x)?),
        };
        let gate = residual(gate, x, layer, Projection::Gate)?;
        let up = residual(up, x, layer, Projection::Up)?;
        let gated = gated_activation(family, &gate, &up, gradients)?;
        residual(
            self.down_proj.forward(&gated)?,
            &gated,
            layer,
            Projection::Down,
        )
    }
}

/// The names of a layer's norms after attention, before the MLP and after
/// it. Gemma has all of them (and llama.cpp names them differently in
/// GGUF); the others only the one before the MLP.
fn norm_names(
    gemma: bool,
    from_gguf: bool,
) -> (Option<&'static str>, &'static str, Option<&'static str>) {
    match (gemma, from_gguf) {
        (true, false) => (
            Some("post_attention_layernorm"),
            "pre_feedforward_layernorm",
            Some("post_feedforward_layernorm"),
        ),
        (true, true) => (
            Some("gemma_post_attention_layernorm"),
            "post_attention_layernorm",
            Some("post_feedforward_layernorm"),
        ),
        (false, _) => (None, "post_attention_layernorm", None),
    }
}

impl Block {
    /// Layer `layer`'s weights, checking every shape (see
    /// [`Transformer::build`]); sliding-window layers take the local rope.
    fn load(
        weights: &mut WeightMap,
        c: &ModelConfig,
        layer: usize,
        from_gguf: bool,
    ) -> Result<Block, LoadError> {
        let p = format!("model.layers.{layer}");
        let (h, offset) = (c.hidden_size, c.norm_weight_offset);
        let attention = Attention::load(weights, c, &p)?;
        let mlp = Mlp::load(weights, c, &p)?;
        let (post_attn, pre_mlp, post_mlp) = norm_names(c.family == Family::Gemma3, from_gguf);
        let mut norm = |name: &str| weights.vector(&format!("{p}.{name}.weight"), h, offset);
        let input_norm = norm("input_layernorm")?;
        let post_attention_norm = post_attn.map(&mut norm).transpose()?;
        let pre_mlp_norm = norm(pre_mlp)?;
        let post_mlp_norm = post_mlp.map(&mut norm).transpose()?;
        let sliding = c.is_sliding(layer);
        Ok(Block {
            input_norm,
            attention,
            post_attention_norm,
            pre_mlp_norm,
            mlp,
            post_mlp_norm,
            sliding_window: if sliding { c.sliding_window } else { None },
            rope_theta: if sliding {
                c.rope_local_theta
            } else {
                c.rope_theta
            },
            rope_scale: if sliding { 1.0 } else { c.rope_scale },
        })
    }

    /// The seven projections as loaded (views of the stacked ones when
    /// stacked).
    fn projections(&self) -> [&Linear; 7] {
        let (a, m) = (&self.attention, &self.mlp);
        [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ]
    }

    /// Stacks q, k and v into one projection, and gate and up into another,
    /// where each group is stored alike (see [`Linear::stack`]). On a GPU
    /// each matmul of a decode step is a kernel launch, and small ones (a
    /// 3B model's k and v) read their weights below the bandwidth larger
    /// ones reach: stacked, a layer launches three fewer.
    fn stack_projections(&mut self) -> MlxResult<()> {
        let a = &mut self.attention;
        a.qkv = Linear::stack(&mut [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj])?;
        let m = &mut self.mlp;
        m.gate_up = Linear::stack(&mut [&mut m.gate_proj, &mut m.up_proj])?;
        Ok(())
    }

    /// RoPE with this layer's settings, the first position at `offset`.
    fn rotate(&self, y: Array, config: &ModelConfig, offset: i32) -> MlxResult<Array> {
        rope(
            y,
            config.head_dim as i32,
            config.rope_traditional,
            self.rope_theta,
            self.rope_scale,
            offset,
            None,
        )
    }

    /// [`Block::rotate`] of a batch, `y`: `[B, heads, 1, head_dim]`, row
    /// `b` at position `offsets[b]`.
    fn rotate_rows(&self, y: &Array, config: &ModelConfig, offsets: &Array) -> MlxResult<Array> {
        mlx_rs::fast::rope_dynamic(
            y,
            config.head_dim as i32,
            config.rope_traditional,
            self.rope_theta,
            self.rope_scale,
            offsets,
            None,
        )
    }

    /// One sequence's attention: its rotated queries `q` (`[1, heads, L,
    /// head_dim]`) over the keys and values of its cache, the new ones
    /// appended; `[1, L, heads, head_dim]`. The native kernel where it
    /// takes the shape, else MLX's, masked causally (and by this layer's
    /// window) beyond a single query.
    #[inline]
    fn attend(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        span: Span,
        scale: f32,
        head_dim: usize,
    ) -> MlxResult<Array> {
        if kernels::causal_attention_is_native(q, head_dim) {
            let window = self.sliding_window.unwrap_or(0);
            let first_query = span.offset - span.cached_start;
            return kernels::causal_attention(q, k, v, scale, first_query, window);
        }
        let key_count = k.shape()[2] as usize;
        let window_mask;
        let mask = if span.length == 1 {
            Mask::None
        } else if let Some(window) = self.sliding_window.filter(|&w| key_count > w) {
            window_mask = sliding_mask(
                span.offset,
                span.length,
                span.cached_start,
                key_count,
                window,
            );
            Mask::Array(&window_mask)
        } else {
            Mask::Causal
        };
        // [1, heads, L, head_dim] -> [1, L, heads, head_dim], as the native kernel gives.
        attention(q, k, v, scale, mask)?.transpose_axes(&[0, 2, 1, 3])
    }
}

/// What a decode step hands back: every row's float32 logits, or each
/// row's token where the device picked them (`None`: the row joined the
/// step that runs ahead, and gets its token from the next call; see
/// [`Transformer::decode_greedy`]).
pub enum Decoded {
    Logits(Vec<f32>),
    Tokens(Vec<Option<u32>>),
}

/// A greedy pick on the device (see [`Transformer::decode_greedy`]): the
/// rows (`ban_rows[b]`) that may not choose any token of `banned` (their
/// requests ignore end-of-sequence).
pub struct GreedyPick<'a> {
    pub banned: &'a [u32],
    pub ban_rows: &'a [bool],
}

/// Where one sequence's queries and cached keys sit: its first new
/// position, its new positions, and the position of its cache's first key.
#[derive(Clone, Copy)]
struct Span {
    offset: usize,
    length: usize,
    cached_start: usize,
}

/// A loaded decoder-only transformer.
pub struct Transformer {
    pub config: ModelConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    final_norm: Array,
    lm_head: Option<Linear>,
    /// The weights as the native decode step reads them, built at its first
    /// use; `None` when some matrix is not in a layout the kernels read.
    native: OnceLock<Option<NativeDecoder>>,
    /// The decode batch's keys and values on a GPU (see `slab`).
    slab: std::sync::Mutex<Option<slab::DecodeSlab>>,
    /// This rank's part of a model split over processes (see `sharded`).
    tp: Option<sharded::TensorParallel>,
    /// Whether prompts with nothing cached attend together (see `fresh`).
    fresh_together: bool,
}

impl Transformer {
    /// Assembles the model from `weights`, checking every tensor's shape.
    /// `from_gguf` selects llama.cpp's naming of Gemma's norms.
    pub fn build(
        config: ModelConfig,
        weights: &mut WeightMap,
        from_gguf: bool,
    ) -> Result<Transformer, LoadError> {
        let c = &config;
        let (h, offset) = (c.hidden_size, c.norm_weight_offset);
        let embed = weights.embedding("model.embed_tokens.weight", c.vocab_size, h)?;
        let mut blocks = Vec::with_capacity(c.layers);
        let stack = stacks_projections();
        for layer in 0..c.layers {
            let mut block = Block::load(weights, c, layer, from_gguf)?;
            if stack {
                // Layer by layer: the separate weights go as each is stacked.
                block
                    .stack_projections()
                    .map_err(|e| LoadError::Mlx(e.to_string()))?;
            }
            blocks.push(block);
        }
        let final_norm = weights.vector("model.norm.weight", h, offset)?;
        let lm_head = if weights.contains("lm_head.weight") {
            Some(weights.linear("lm_head", c.vocab_size, h)?)
        } else if c.tie_word_embeddings || from_gguf {
            None
        } else {
            return Err(LoadError::MissingTensor("lm_head.weight".into()));
        };
        Ok(Transformer {
            config,
            embed,
            blocks,
            final_norm,
            lm_head,
            native: OnceLock::new(),
            slab: std::sync::Mutex::new(None),
            tp: None,
            fresh_together: fresh::asked(),
        })
    }

    /// Stacks every layer's projections as a GPU does at load (see
    /// `Block::stack_projections`); the function computed is the same.
    pub fn stack_projections(&mut self) -> MlxResult<()> {
        self.blocks
            .iter_mut()
            .try_for_each(Block::stack_projections)
    }

    /// Makes prompts with nothing cached, prefilled together, attend in one
    /// call (`on`) or one by one, whatever `MLXGATE_FRESH_TOGETHER` says;
    /// the function computed is the same.
    pub fn attend_fresh_together(&mut self, on: bool) {
        self.fresh_together = on;
    }

    /// Every weight array, to evaluate once at load: casts and renames are
    /// lazy in MLX, and the first request should not pay for them.
    pub fn parameters(&self) -> Vec<&Array> {
        fn linear(l: &Linear) -> Vec<&Array> {
            let mut arrays = l.kernel.arrays();
            arrays.extend(l.bias.iter());
            arrays
        }
        let mut arrays = self.embed.kernel.arrays();
        arrays.push(&self.final_norm);
        arrays.extend(self.lm_head.iter().flat_map(linear));
        for block in &self.blocks {
            let a = &block.attention;
            for l in block.projections() {
                arrays.extend(linear(l));
            }
            arrays.extend(a.q_norm.iter().chain(a.k_norm.iter()));
            arrays.push(&block.input_norm);
            arrays.push(&block.pre_mlp_norm);
            arrays.extend(
                block
                    .post_attention_norm
                    .iter()
                    .chain(block.post_mlp_norm.iter()),
            );
        }
        arrays
    }

    /// The dense matrices decode multiplies through [`Kernel::apply`]: the
    /// output head (the embedding table when tied) and each block's
    /// projections, stacked ones included. The decode matmul's warm-up
    /// compiles for these shapes only: a quantized model's scales and
    /// biases are 2-D too, and warming up every parameter compiled the
    /// kernel for them, which decode never runs.
    fn dense_weights(&self) -> Vec<&Array> {
        let head = self
            .lm_head
            .as_ref()
            .map_or(&self.embed.kernel, |l| &l.kernel);
        let mut kernels = vec![head];
        for block in &self.blocks {
            let (a, m) = (&block.attention, &block.mlp);
            kernels.extend(
                block
                    .projections()
                    .into_iter()
                    .chain(&a.qkv)
                    .chain(&m.gate_up)
                    .map(|l| &l.kernel),
            );
        }
        kernels
            .into_iter()
            .filter_map(|kernel| match kernel {
                Kernel::Dense(weight) => Some(weight),
                Kernel::Quantized { .. } => None,
            })
            .collect()
    }

    /// How the projections are stored, for cache fingerprints:
    /// `affine-4bit-g32`, or `dense`.
    pub fn quantization_label(&self) -> String {
        match self
            .blocks
            .first()
            .and_then(|b| b.attention.q_proj.kernel.quantization())
        {
            Some((group, bits)) => format!("affine-{bits}bit-g{group}"),
            None => "dense".into(),
        }
    }

    /// A fresh cache shaped for this model (on rank 0 of a served process
    /// group, with the ticket the workers keep their part under).
    pub fn new_cache(&self) -> KvCache {
        let mut cache = KvCache::new(self.blocks.iter().map(|b| b.sliding_window));
        if self.tp.is_some() {
            cache.ticket = lockstep::leader().map(|leader| leader.ticket());
        }
        cache
    }

    /// Whether this is one process's part of a model split over several.
    pub fn is_split(&self) -> bool {
        self.tp.is_some()
    }

    /// `(in, out)` features of every projection, for adapter mounts.
    pub fn lora_targets(&self) -> Targets {
        let c = &self.config;
        let (h, q, kv, i) = (
            c.hidden_size,
            c.heads * c.head_dim,
            c.kv_heads * c.head_dim,
            c.intermediate_size,
        );
        let mut targets = Targets::new();
        for layer in 0..self.blocks.len() {
            for (projection, dims) in [
                (Projection::Q, (h, q)),
                (Projection::K, (h, kv)),
                (Projection::V, (h, kv)),
                (Projection::O, (q, h)),
                (Projection::Gate, (h, i)),
                (Projection::Up, (h, i)),
                (Projection::Down, (i, h)),
            ] {
                targets.insert((layer, projection), dims);
            }
        }
        targets
    }

    /// Runs `tokens` (B sequences, of any lengths: one pass over the
    /// weights, left-padded to the longest) through the base model,
    /// extending each sequence's cache; returns logits of each sequence's
    /// last position, `[B, vocab]`, as float32.
    pub fn forward(&self, tokens: &[&[u32]], caches: &mut [&mut KvCache]) -> MlxResult<Array> {
        let none = AdapterStack::new();
        let stacks = vec![&none; tokens.len()];
        self.forward_with_adapters(tokens, caches, &stacks)
    }

    /// One decode step: `tokens[b]` extends `caches[b]`; float32 logits,
    /// `[B * vocab]`. Runs natively, outside MLX's graph, when this thread
    /// uses the native kernels, the kernels read every matrix of the model
    /// and every adapter in the batch has its native copy (f32 activations);
    /// else through MLX like any other step.
    pub fn decode(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
    ) -> MlxResult<Vec<f32>> {
        if let Some(decoder) = self.native_step(adapters) {
            return decoder.step(&self.config, tokens, caches, adapters);
        }
        if self.decodes_in_slab(adapters) {
            return match self.decode_in_slab(tokens, caches, adapters, None)? {
                Decoded::Logits(logits) => Ok(logits),
                Decoded::Tokens(_) => unreachable!("no pick was asked for"),
            };
        }
        let inputs: Vec<[u32; 1]> = tokens.iter().map(|&token| [token]).collect();
        let sequences: Vec<&[u32]> = inputs.iter().map(|t| t.as_slice()).collect();
        let logits = self.forward_with_adapters(&sequences, caches, adapters)?;
        mlx_rs::transforms::eval(
            std::iter::once(&logits).chain(caches.iter().flat_map(|c| c.arrays())),
        )?;
        Ok(logits.as_slice::<f32>().to_vec())
    }

    /// Whether [`Transformer::decode`] of a batch with these adapters runs
    /// through the slab (a GPU, or `MLXGATE_DECODE_SLAB=1`), where
    /// [`Transformer::decode_greedy`] can pick tokens on the device.
    pub fn decodes_in_slab(&self, adapters: &[&AdapterStack]) -> bool {
        self.native_step(adapters).is_none()
            && self.tp.is_none()
            && slab::enabled()
            && self.blocks.iter().all(|b| b.sliding_window.is_none())
    }

    /// [`Transformer::decode`] for a batch whose every row picks its most
    /// likely token (greedy, with nothing else to apply): the device picks,
    /// each row of `pick.ban_rows` never choosing a token of `pick.banned`,
    /// and only the tokens come back, not `[B * vocab]` floats (at 32 rows
    /// that read and the host's argmax were a fifth of a GPU step). Ties go
    /// to the lowest token id, as on the host. Only where
    /// [`Transformer::decodes_in_slab`] holds.
    ///
    /// Without adapters the next step is launched before this one's tokens
    /// are read, fed by them on the device: a caller that feeds each token
    /// back finds it already running. A row new to the batch then joins
    /// that next step: its token is `None` now, and comes from the next
    /// call with the same input (its cache has not moved).
    pub fn decode_greedy(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
        pick: &GreedyPick,
    ) -> MlxResult<Vec<Option<u32>>> {
        debug_assert!(self.decodes_in_slab(adapters));
        match self.decode_in_slab(tokens, caches, adapters, Some(pick))? {
            Decoded::Tokens(tokens) => Ok(tokens),
            Decoded::Logits(_) => unreachable!("a pick was asked for"),
        }
    }

    /// Gets decoding ready now rather than in the first request: the native
    /// decode step's weights where this thread decodes natively (repacking
    /// takes up to a second on larger models), the GPU's ragged attention
    /// kernels where steps use them and its decode matmul for each weight
    /// shape (compiling takes ~2 s a kernel).
    pub fn prepare_decode(&self) {
        if kernels::thread_choice() == KernelChoice::Native {
            self.native_decoder();
        }
        if let Err(error) = self.warm_up_slab() {
            tracing::warn!(%error, "cannot compile the GPU's ragged attention kernel");
        }
        if let Err(error) =
            kernels::warm_up_decode_matmul(self.dense_weights(), self.gated_weights())
        {
            tracing::warn!(%error, "cannot compile the GPU's decode matmul kernel");
        }
    }

    /// The stacked gate/up weights a decode step may run through the gated
    /// decode matmul ([`Mlp::gated_weight`]).
    fn gated_weights(&self) -> impl Iterator<Item = &Array> {
        let family = self.config.family;
        self.blocks
            .iter()
            .filter_map(move |b| b.mlp.gated_weight(family))
    }

    /// Bytes of weights a native decode step reads per token (the roofline
    /// of decoding); `None` where decode does not run natively.
    pub fn native_decode_weight_bytes(&self) -> Option<usize> {
        if kernels::thread_choice() != KernelChoice::Native {
            return None;
        }
        self.native_decoder()
            .map(NativeDecoder::weight_bytes_per_token)
    }

    /// The native decode step, where it takes a batch with these adapters:
    /// this thread runs the native kernels and every adapter has its
    /// native copy (f32 activations).
    fn native_step(&self, adapters: &[&AdapterStack]) -> Option<&NativeDecoder> {
        let native = kernels::thread_choice() == KernelChoice::Native
            && adapters.iter().all(|stack| lora::is_native(stack));
        native.then(|| self.native_decoder()).flatten()
    }

    /// The native decode step's weights; never for a shard, whose step needs
    /// the all-sums the native step lacks.
    fn native_decoder(&self) -> Option<&NativeDecoder> {
        if self.tp.is_some() {
            return None;
        }
        self.native
            .get_or_init(|| match NativeDecoder::new(self) {
                Ok(decoder) => decoder,
                Err(error) => {
                    tracing::warn!(%error, "native decode unavailable; decoding through MLX");
                    None
                }
            })
            .as_ref()
    }

    /// [`Transformer::forward`] with each sequence's adapter stack (empty
    /// for the base model).
    pub fn forward_with_adapters(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
    ) -> MlxResult<Array> {
        // Rank 0 of a served group tells its workers first, and holds the
        // group until the pass is evaluated.
        let Some(leader) = lockstep::leader().filter(|_| self.tp.is_some()) else {
            return self.forward_pass(tokens, caches, adapters);
        };
        let step = leader
            .begin_step(tokens, caches)
            .map_err(Exception::custom)?;
        // The workers run this pass whatever happens here: a pass that fails
        // on this rank leaves the ranks out of step, so the group breaks.
        let logits = self
            .forward_pass(tokens, caches, adapters)
            .map_err(|error| {
                let why = lockstep::step_error(&error);
                leader.step_failed(&why);
                Exception::custom(why)
            })?;
        drop(step);
        Ok(logits)
    }

    /// [`Transformer::forward_with_adapters`] on this process alone
    /// (evaluated, on a split model: its all-sums run now).
    fn forward_pass(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut KvCache],
        adapters: &[&AdapterStack],
    ) -> MlxResult<Array> {
        for cache in caches.iter_mut() {
            cache.settle()?;
        }
        let ids = token_ids(tokens);
        let length = ids.shape()[1];
        let lengths: Vec<i32> = tokens.iter().map(|t| t.len() as i32).collect();
        let fresh = if self.fresh_together {
            FreshRows::of(caches, &lengths, length)?
        } else {
            None
        };
        let mut x = self.embed_ids(&ids)?;
        let eps = self.config.rms_norm_eps;
        for (index, block) in self.blocks.iter().enumerate() {
            let normed = rms_norm(&x, Some(&block.input_norm), eps)?;
            let mut attended = self.attention(
                block,
                index,
                &normed,
                (caches, &lengths, fresh.as_ref()),
                adapters,
            )?;
            if let Some(norm) = &block.post_attention_norm {
                attended = rms_norm(&attended, Some(norm), eps)?;
            }
            x = add(&x, &attended)?;
            let normed = rms_norm(&x, Some(&block.pre_mlp_norm), eps)?;
            let mut mlp = self.mlp(&block.mlp, index, &normed, adapters)?;
            if let Some(norm) = &block.post_mlp_norm {
                mlp = rms_norm(&mlp, Some(norm), eps)?;
            }
            x = add(&x, &mlp)?;
        }
        for (cache, tokens) in caches.iter_mut().zip(tokens) {
            cache.offset += tokens.len();
            for layer in &mut cache.layers {
                layer.trim()?;
            }
        }
        let last = x.index((.., length - 1, ..));
        let last = rms_norm(&last, Some(&self.final_norm), eps)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&last)?,
            None => self.embed.as_logits(&last)?,
        };
        let logits = logits.as_dtype(Dtype::Float32)?;
        if self.tp.is_some() {
            // A split pass runs its all-sums now (on rank 0 of a served
            // group, while the group is held).
            mlx_rs::transforms::eval(
                std::iter::once(&logits).chain(caches.iter().flat_map(|c| c.arrays())),
            )?;
        }
        Ok(logits)
    }

    /// A copy whose linear layers and embedding hold dense (dequantized)
    /// matrices, sharing every other array. Training uses it on MLX's CPU
    /// backend, where dense float32 matmuls (BLAS) are far faster than
    /// quantized ones; the function computed is the same.
    pub fn dequantized(&self) -> MlxResult<Transformer> {
        fn dense(l: &Linear) -> MlxResult<Linear> {
            Ok(Linear {
                kernel: Kernel::Dense(l.kernel.dense()?.as_dtype(super::compute_dtype())?),
                bias: l.bias.clone(),
            })
        }
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let a = &b.attention;
            blocks.push(Block {
                input_norm: b.input_norm.clone(),
                attention: Attention {
                    q_proj: dense(&a.q_proj)?,
                    k_proj: dense(&a.k_proj)?,
                    v_proj: dense(&a.v_proj)?,
                    o_proj: dense(&a.o_proj)?,
                    qkv: None,
                    q_norm: a.q_norm.clone(),
                    k_norm: a.k_norm.clone(),
                },
                post_attention_norm: b.post_attention_norm.clone(),
                pre_mlp_norm: b.pre_mlp_norm.clone(),
                mlp: Mlp {
                    gate_proj: dense(&b.mlp.gate_proj)?,
                    up_proj: dense(&b.mlp.up_proj)?,
                    down_proj: dense(&b.mlp.down_proj)?,
                    gate_up: None,
                },
                post_mlp_norm: b.post_mlp_norm.clone(),
                sliding_window: b.sliding_window,
                rope_theta: b.rope_theta,
                rope_scale: b.rope_scale,
            });
        }
        let dtype = super::compute_dtype();
        let table = self.embed.kernel.dense()?.as_dtype(dtype)?;
        Ok(Transformer {
            config: self.config.clone(),
            embed: Embedding {
                kernel: Kernel::Dense(table),
            },
            blocks,
            final_norm: self.final_norm.clone(),
            lm_head: self.lm_head.as_ref().map(dense).transpose()?,
            native: OnceLock::new(),
            slab: std::sync::Mutex::new(None),
            tp: None,
            fresh_together: self.fresh_together,
        })
    }

    /// The final-normed hidden states of every position, `[B, L, hidden]`,
    /// of the token ids `ids` (`[B, L]`, uint32), without a KV cache. Every
    /// projection's output goes through `residual(y, x, layer, projection)`
    /// (`y` its base output, `x` its input), which training uses to add
    /// LoRA deltas that autograd can differentiate.
    pub fn forward_hidden_with(
        &self,
        ids: &Array,
        residual: &dyn Fn(Array, &Array, usize, Projection) -> MlxResult<Array>,
    ) -> MlxResult<Array> {
        if self.tp.is_some() {
            return Err(mlx_rs::error::Exception::custom(
                "training and embeddings are not available on a model split over processes",
            ));
        }
        let c = &self.config;
        let mut x = self.embed_ids(ids)?;
        let shape = x.shape().to_vec();
        let (batch, length) = (shape[0], shape[1]);
        let (heads, head_dim) = (c.heads as i32, c.head_dim as i32);
        let eps = c.rms_norm_eps;
        let scale = c.attention_scale();
        for (layer, block) in self.blocks.iter().enumerate() {
            let a = &block.attention;
            let normed = rms_norm(&x, Some(&block.input_norm), eps)?;
            let (q, k, v) = a.project(&normed, layer, residual, c)?;
            let q = block.rotate(q, c, 0)?;
            let k = block.rotate(k, c, 0)?;
            let window_mask;
            let mask = match block.sliding_window.filter(|&w| length as usize > w) {
                Some(window) => {
                    window_mask = sliding_mask(0, length as usize, 0, length as usize, window);
                    Mask::Array(&window_mask)
                }
                None => Mask::Causal,
            };
            let attended = attention(&q, &k, &v, scale, mask)?
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[batch, length, heads * head_dim])?;
            let mut attended = a.output(&attended, layer, residual)?;
            if let Some(norm) = &block.post_attention_norm {
                attended = rms_norm(&attended, Some(norm), eps)?;
            }
            x = add(&x, &attended)?;
            let normed = rms_norm(&x, Some(&block.pre_mlp_norm), eps)?;
            let mut mlp =
                block
                    .mlp
                    .forward(&normed, (layer, c.family), residual, Gradients::Needed)?;
            if let Some(norm) = &block.post_mlp_norm {
                mlp = rms_norm(&mlp, Some(norm), eps)?;
            }
            x = add(&x, &mlp)?;
        }
        rms_norm(&x, Some(&self.final_norm), eps)
    }

    /// Embeddings of `ids`, scaled where the family scales them (Gemma).
    fn embed_ids(&self, ids: &Array) -> MlxResult<Array> {
        let x = self.embed.lookup(ids)?;
        match self.config.embedding_scale() {
            Some(scale) => multiply(&x, Array::from_f32(scale)),
            None => Ok(x),
        }
    }

    /// Float32 logits of final-normed hidden states (any leading shape).
    pub fn logits_of_hidden(&self, hidden: &Array) -> MlxResult<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(hidden)?,
            None => self.embed.as_logits(hidden)?,
        };
        logits.as_dtype(Dtype::Float32)
    }

    /// Layer `layer`'s MLP of `x` for inference: gate, up and SiLU in one
    /// launch where the MLP has a [`Mlp::gated_weight`], the decode matmul
    /// takes `x` (a GPU's few rows; the kernel has no gradient, which
    /// inference needs none of) and no adapter of the batch changes gate or
    /// up; summed over ranks when split.
    fn mlp(
        &self,
        mlp: &Mlp,
        layer: usize,
        x: &Array,
        adapters: &[&AdapterStack],
    ) -> MlxResult<Array> {
        let with_adapters = lora::residual_of(adapters);
        let gated = mlp.gated_weight(self.config.family).filter(|weight| {
            kernels::decode_matmul_applies(x, weight)
                && !lora::touches(adapters, layer, &[Projection::Gate, Projection::Up])
        });
        let out = match gated {
            Some(weight) => {
                let gated = kernels::decode_gated_matmul(x, weight)?;
                with_adapters(
                    mlp.down_proj.forward(&gated)?,
                    &gated,
                    layer,
                    Projection::Down,
                )?
            }
            None => mlp.forward(
                x,
                (layer, self.config.family),
                &with_adapters,
                Gradients::NotNeeded,
            )?,
        };
        self.all_ranks(out, true)
    }

    /// Attention of B sequences (`x`: `[B, L, hidden]`, left-padded: each
    /// sequence's `lengths[b]` tokens are its last columns), each over its
    /// own cache; what padding columns hold means nothing. Rows with nothing
    /// cached (`fresh`) attend in one masked call; the others one by one.
    fn attention(
        &self,
        block: &Block,
        layer: usize,
        x: &Array,
        (caches, lengths, fresh): (&mut [&mut KvCache], &[i32], Option<&FreshRows>),
        adapters: &[&AdapterStack],
    ) -> MlxResult<Array> {
        let c = &self.config;
        let with_adapters = lora::residual_of(adapters);
        let shape = x.shape();
        let (batch, length) = (shape[0], shape[1]);
        let (heads, head_dim) = (c.heads as i32, c.head_dim as i32);
        let a = &block.attention;
        let (queries, keys, values) = a.project(x, layer, &with_adapters, c)?;
        let scale = c.attention_scale();
        // Every row rotates in one op, each at its own position (a
        // left-padded row's first token at its cache's offset): a graph node
        // per row costs MLX's CPU backend microseconds and a GPU a kernel
        // launch.
        let (queries, keys) = if batch > 1 {
            let offsets: Vec<i32> = (caches.iter().zip(lengths))
                .map(|(cache, &n)| cache.offset as i32 - (length - n))
                .collect();
            let offsets = Array::from_slice(&offsets, &[batch]);
            (
                block.rotate_rows(&queries, c, &offsets)?,
                block.rotate_rows(&keys, c, &offsets)?,
            )
        } else {
            let offset = caches[0].offset as i32;
            (
                block.rotate(queries, c, offset)?,
                block.rotate(keys, c, offset)?,
            )
        };
        let together = match fresh {
            Some(fresh) => {
                let mask = fresh.mask(block.sliding_window)?;
                Some(
                    attention(&queries, &keys, &values, scale, Mask::Array(&mask))?
                        .transpose_axes(&[0, 2, 1, 3])?,
                )
            }
            None => None,
        };
        let mut outputs = Vec::with_capacity(batch as usize);
        for (row, cache) in caches.iter_mut().enumerate() {
            let b = row as i32;
            let offset = cache.offset as i32;
            // One sequence (the common case) needs no per-sequence slices;
            // a shorter one in a batch, its own columns.
            let pad = length - lengths[row];
            let one = |all: &Array| {
                let row = if batch == 1 {
                    all.clone()
                } else {
                    all.index(b..b + 1)
                };
                if pad == 0 {
                    row
                } else {
                    row.index((.., .., pad.., ..))
                }
            };
            let (q, k) = (one(&queries), one(&keys));
            let v = one(&values);
            let layer_cache = &mut cache.layers[layer];
            if let Some(together) = together
                .as_ref()
                .filter(|_| fresh.is_some_and(|f| f.rows[row]))
            {
                layer_cache.append(k, v)?;
                outputs.push(together.index(b..b + 1));
                continue;
            }
            let span = Span {
                offset: offset as usize,
                length: (length - pad) as usize,
                cached_start: layer_cache.start,
            };
            let (k, v) = layer_cache.append(k, v)?;
            let attended = block.attend(&q, &k, &v, span, scale, c.head_dim)?;
            outputs.push(if pad == 0 {
                attended
            } else {
                let padding = zeros_dtype(&[1, pad, heads, head_dim], attended.dtype())?;
                concatenate(&[padding, attended], 1)?
            });
        }
        let attended = match together {
            Some(together) if fresh.is_some_and(FreshRows::all) => together,
            _ if outputs.len() == 1 => outputs.pop().expect("one output"),
            _ => concatenate(&outputs, 0)?,
        };
        let merged = attended.reshape(&[batch, length, heads * head_dim])?;
        let split = self.tp.as_ref().is_some_and(|tp| tp.attention_split);
        let out = a.output(&merged, layer, &with_adapters)?;
        self.all_ranks(out, split)
    }
}

/// Whether autograd will differentiate through an op (training), which the
/// native kernels without a gradient must stay out of.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gradients {
    Needed,
    NotNeeded,
}

/// Whether models stack their projections as they load
/// ([`Block::stack_projections`]): only when `MLXGATE_STACK_PROJECTIONS=1`.
/// Stacked, a GPU decode step of up to 4 rows also runs gate, up and SiLU
/// in one launch and rotates queries and keys in one: on an H100 (8B) that
/// cut the host's share of a one-row step from 5.3 to 3.3 ms, but the step
/// was the GPU's to pace there (7.5 ms either way; 4 rows 1.03x). Before
/// those, a 3B measured no gain (one stream 273 tok/s against 277; 32
/// streams 0.88-0.93x), and on the CPU the native kernels take each
/// projection packed on its own; so it stays off until a GPU where the host
/// sets the pace (an H200) measures it.
fn stacks_projections() -> bool {
    std::env::var("MLXGATE_STACK_PROJECTIONS").is_ok_and(|asked| asked == "1")
}

/// The MLP's gated activation, `act(gate) * up`: GELU (tanh form) for Gemma,
/// SiLU for the rest, the latter by the native kernel where it may run.
fn gated_activation(
    family: Family,
    gate: &Array,
    up: &Array,
    gradients: Gradients,
) -> MlxResult<Array> {
    match family {
        Family::Gemma3 => compiled::geglu_tanh(gate, up),
        _ if gradients == Gradients::NotNeeded && kernels::silu_multiply_is_native(gate, up) => {
            kernels::silu_multiply(gate, up)
        }
        _ => compiled::swiglu(gate, up),
    }
}

/// B sequences of equal length as a `[B, L]` array of token ids.
fn token_ids(tokens: &[&[u32]]) -> Array {
    let length = tokens.iter().map(|t| t.len()).max().unwrap_or(0);
    let mut flat = Vec::with_capacity(tokens.len() * length);
    for t in tokens {
        // Left-padded: every sequence's last token is in the last column.
        flat.extend(std::iter::repeat_n(0, length - t.len()));
        flat.extend_from_slice(t);
    }
    Array::from_slice(&flat, &[tokens.len() as i32, length as i32])
}

/// Boolean `[queries, keys]` mask: causal and within `window` positions.
fn sliding_mask(
    first_query: usize,
    queries: usize,
    first_key: usize,
    keys: usize,
    window: usize,
) -> Array {
    let mut allowed = Vec::with_capacity(queries * keys);
    for i in 0..queries {
        let q = first_query + i;
        for j in 0..keys {
            let k = first_key + j;
            allowed.push(k <= q && k + window > q);
        }
    }
    Array::from_slice(&allowed, &[queries as i32, keys as i32])
}
