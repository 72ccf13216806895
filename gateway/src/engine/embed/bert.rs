//! BERT-family encoders (absolute positions, post-norm, GELU), the models
//! sentence-transformers builds on, as one MLX graph per padded batch.
//!
//! Tokens run as rows, the inputs of a batch packed one after another with
//! no padding: the hidden state is `[tokens, hidden]`, so every projection
//! is one GEMM (`addmm`, bias fused) over the whole batch, and only
//! attention splits it, per input, over that input's own tokens.

use std::path::Path;

use mlx_rs::fast::layer_norm;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{add, addmm, concatenate};
use mlx_rs::{Array, Dtype};

use crate::engine::model::LoadError;
use crate::engine::model::weights::{Kernel, MlxResult, WeightMap};
use crate::mlx::attention::{Mask, attention};
use crate::mlx::kernels;

/// The facts of `config.json` the forward needs.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f32,
    activation: Activation,
}

/// `hidden_act`: BERT's `gelu` is the exact (erf) one.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Activation {
    Gelu,
    GeluTanh,
    Relu,
}

impl BertConfig {
    /// From a Hugging Face `config.json` of `model_type` `bert`.
    pub fn from_json(json: &serde_json::Value) -> Result<BertConfig, LoadError> {
        let number = |key: &'static str| {
            json[key]
                .as_u64()
                .map(|v| v as usize)
                .ok_or(LoadError::MissingConfig(key))
        };
        let activation = match json["hidden_act"].as_str().unwrap_or("gelu") {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            other => {
                return Err(LoadError::UnsupportedArchitecture(format!(
                    "bert with hidden_act `{other}` (supported: gelu, gelu_new, relu)"
                )));
            }
        };
        if json["position_embedding_type"]
            .as_str()
            .is_some_and(|p| p != "absolute")
        {
            return Err(LoadError::UnsupportedArchitecture(
                "bert with relative position embeddings".into(),
            ));
        }
        Ok(BertConfig {
            vocab_size: number("vocab_size")?,
            hidden_size: number("hidden_size")?,
            layers: number("num_hidden_layers")?,
            heads: number("num_attention_heads")?,
            intermediate_size: number("intermediate_size")?,
            max_position_embeddings: number("max_position_embeddings")?,
            type_vocab_size: number("type_vocab_size").unwrap_or(2),
            layer_norm_eps: json["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32,
            activation,
        })
    }
}

/// `y = x W^T + b`, its weight laid out once at load for the product that
/// runs it.
struct Dense {
    weight: DenseWeight,
    bias: Array,
}

enum DenseWeight {
    /// Packed for the native kernel (AVX-512 CPUs).
    Panels(Array),
    /// `W^T`, contiguous `[in, out]`, for MLX's matmul: OpenBLAS packs it
    /// faster than a transposed view (batch 1, 100 tokens: 23 ms a text
    /// against 32).
    Transposed(Array),
}

impl Dense {
    fn new(weight: Array, bias: Array) -> MlxResult<Dense> {
        let out = weight.shape()[0] as usize;
        let weight = if kernels::dense_is_native(out) {
            DenseWeight::Panels(kernels::dense_panels(&weight)?)
        } else {
            DenseWeight::Transposed(weight.t().contiguous()?)
        };
        Ok(Dense { weight, bias })
    }

    fn forward(&self, x: &Array) -> MlxResult<Array> {
        match &self.weight {
            DenseWeight::Panels(panels) => kernels::dense(x, panels, &self.bias),
            DenseWeight::Transposed(weight_t) => addmm(&self.bias, x, weight_t, None, None),
        }
    }

    fn arrays(&self) -> [&Array; 2] {
        match &self.weight {
            DenseWeight::Panels(w) | DenseWeight::Transposed(w) => [w, &self.bias],
        }
    }
}

struct Norm {
    weight: Array,
    bias: Array,
}

struct Layer {
    /// Query, key and value as one `[hidden, 3 * hidden]` product.
    qkv: Dense,
    attention_out: Dense,
    attention_norm: Norm,
    intermediate: Dense,
    output: Dense,
    output_norm: Norm,
}

pub struct Bert {
    pub config: BertConfig,
    words: Array,
    positions: Array,
    /// Row 0 of the token-type table: every input is one segment.
    segment: Array,
    embedding_norm: Norm,
    layers: Vec<Layer>,
}

impl Bert {
    /// Reads `model.safetensors` (names with or without a `bert.` prefix).
    pub fn load(dir: &Path, config: BertConfig) -> Result<Bert, LoadError> {
        let mut weights = WeightMap::from_safetensors_dir(dir, Dtype::Float32)?;
        let prefix = if weights.contains("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let c = &config;
        let h = c.hidden_size;
        let mut table = |name: &str, rows: usize| -> Result<Array, LoadError> {
            match weights
                .embedding(&format!("{prefix}embeddings.{name}.weight"), rows, h)?
                .kernel
            {
                Kernel::Dense(table) => Ok(table),
                Kernel::Quantized { .. } => Err(LoadError::ShapeMismatch {
                    name: format!("{prefix}embeddings.{name}.weight"),
                    detail: "quantized encoder weights are not supported".into(),
                }),
            }
        };
        let words = table("word_embeddings", c.vocab_size)?;
        let positions = table("position_embeddings", c.max_position_embeddings)?;
        let segments = table("token_type_embeddings", c.type_vocab_size)?;
        let segment = segments
            .take_axis(Array::from_slice(&[0u32], &[1]), 0)
            .map_err(mlx)?;
        let embedding_norm = norm(&mut weights, &format!("{prefix}embeddings.LayerNorm"), h)?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let at = format!("{prefix}encoder.layer.{i}");
            let (q, q_bias) = linear(&mut weights, &format!("{at}.attention.self.query"), h, h)?;
            let (k, k_bias) = linear(&mut weights, &format!("{at}.attention.self.key"), h, h)?;
            let (v, v_bias) = linear(&mut weights, &format!("{at}.attention.self.value"), h, h)?;
            let qkv = Dense::new(
                concatenate(&[q, k, v], 0).map_err(mlx)?,
                concatenate(&[q_bias, k_bias, v_bias], 0).map_err(mlx)?,
            )
            .map_err(mlx)?;
            let inner = c.intermediate_size;
            layers.push(Layer {
                qkv,
                attention_out: dense(&mut weights, &format!("{at}.attention.output.dense"), h, h)?,
                attention_norm: norm(&mut weights, &format!("{at}.attention.output.LayerNorm"), h)?,
                intermediate: dense(&mut weights, &format!("{at}.intermediate.dense"), inner, h)?,
                output: dense(&mut weights, &format!("{at}.output.dense"), h, inner)?,
                output_norm: norm(&mut weights, &format!("{at}.output.LayerNorm"), h)?,
            });
        }
        let unused: Vec<String> = weights
            .leftovers()
            .into_iter()
            // Buffers, not weights; the pooler is unused by sentence embeddings.
            .filter(|n| !n.ends_with("position_ids") && !n.contains("pooler."))
            .collect();
        if !unused.is_empty() {
            tracing::warn!(path = %dir.display(), ?unused, "tensors not used by the encoder");
        }
        let bert = Bert {
            config,
            words,
            positions,
            segment,
            embedding_norm,
            layers,
        };
        mlx_rs::transforms::eval(bert.arrays()).map_err(mlx)?;
        Ok(bert)
    }

    /// Whether its products go through MLX's matmul (OpenBLAS) rather than
    /// the native kernel.
    pub fn uses_blas(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.qkv.weight, DenseWeight::Transposed(_)))
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut all = vec![&self.words, &self.positions, &self.segment];
        all.extend([&self.embedding_norm.weight, &self.embedding_norm.bias]);
        for l in &self.layers {
            for d in [&l.qkv, &l.attention_out, &l.intermediate, &l.output] {
                all.extend(d.arrays());
            }
            for n in [&l.attention_norm, &l.output_norm] {
                all.extend([&n.weight, &n.bias]);
            }
        }
        all
    }

    /// The last layer's hidden states, `[tokens, hidden]`, of `ids`: the
    /// inputs of a batch one after another (`lengths` says where each ends),
    /// packed without padding. Each input attends over its own tokens only.
    /// `after_layer` sees each layer's output (still lazy).
    pub fn forward(
        &self,
        ids: &[u32],
        lengths: &[usize],
        after_layer: &mut dyn FnMut(&Array) -> MlxResult<()>,
    ) -> MlxResult<Array> {
        let c = &self.config;
        let tokens = Array::from_slice(ids, &[ids.len() as i32]);
        let position_ids: Vec<u32> = lengths.iter().flat_map(|&n| 0..n as u32).collect();
        let positions = Array::from_slice(&position_ids, &[ids.len() as i32]);
        let embedded = add(
            add(
                self.words.take_axis(&tokens, 0)?,
                self.positions.take_axis(&positions, 0)?,
            )?,
            &self.segment,
        )?;
        let mut x = self.embedding_norm.apply(&embedded, c.layer_norm_eps)?;
        for layer in &self.layers {
            let attended = self.attend(&layer.qkv.forward(&x)?, lengths)?;
            let attended = layer.attention_out.forward(&attended)?;
            x = layer
                .attention_norm
                .apply(&add(&attended, &x)?, c.layer_norm_eps)?;
            let inner = c.activation.apply(&layer.intermediate.forward(&x)?)?;
            let out = layer.output.forward(&inner)?;
            x = layer.output_norm.apply(&add(&out, &x)?, c.layer_norm_eps)?;
            after_layer(&x)?;
        }
        Ok(x)
    }

    /// Bidirectional attention of each input over itself, from the packed
    /// `[tokens, 3 * hidden]` projections: the native encoder kernel (one
    /// call for the batch) on AVX-512 CPUs; else per input, the native
    /// prefill kernel (a query placed at the last key sees every key) or
    /// MLX's attention.
    fn attend(&self, qkv: &Array, lengths: &[usize]) -> MlxResult<Array> {
        let c = &self.config;
        let (heads, head_dim) = (c.heads as i32, (c.hidden_size / c.heads) as i32);
        let scale = 1.0 / (head_dim as f32).sqrt();
        if kernels::encoder_attention_is_native(head_dim as usize) {
            return kernels::encoder_attention(qkv, lengths, c.heads, scale);
        }
        let native = kernels::causal_attention_is_native(qkv, head_dim as usize);
        let mut parts = Vec::with_capacity(lengths.len());
        let mut start = 0;
        for &n in lengths {
            let rows = qkv
                .index(start as i32..(start + n) as i32)
                .reshape(&[n as i32, 3, heads, head_dim])?;
            // [1, heads, n, head_dim]
            // Heads apart, each head's rows contiguous: the kernel's scan
            // over one head's keys then stays within a few pages.
            let part = |i: i32| {
                rows.index((.., i))
                    .transpose_axes(&[1, 0, 2])?
                    .contiguous()?
                    .expand_dims(0)
            };
            let (q, k, v) = (part(0)?, part(1)?, part(2)?);
            let out = if native {
                kernels::causal_attention(&q, &k, &v, scale, n - 1, 0)?
            } else {
                attention(&q, &k, &v, scale, Mask::None)?.transpose_axes(&[0, 2, 1, 3])?
            };
            parts.push(out.reshape(&[n as i32, c.hidden_size as i32])?);
            start += n;
        }
        concatenate(&parts, 0)
    }
}

impl Activation {
    fn apply(self, x: &Array) -> MlxResult<Array> {
        match self {
            Activation::Gelu if kernels::gelu_is_native(x) => kernels::gelu(x),
            Activation::Gelu => crate::mlx::compiled::gelu(x),
            Activation::GeluTanh => crate::mlx::compiled::gelu_tanh(x),
            Activation::Relu => mlx_rs::nn::relu(x),
        }
    }
}

impl Norm {
    fn apply(&self, x: &Array, eps: f32) -> MlxResult<Array> {
        layer_norm(x, &self.weight, &self.bias, eps)
    }
}

/// A dense linear's weight `[out, in]` and bias, as stored.
fn linear(
    weights: &mut WeightMap,
    prefix: &str,
    out: usize,
    input: usize,
) -> Result<(Array, Array), LoadError> {
    let linear = weights.linear(prefix, out, input)?;
    let (Kernel::Dense(weight), Some(bias)) = (linear.kernel, linear.bias) else {
        return Err(LoadError::ShapeMismatch {
            name: format!("{prefix}.weight"),
            detail: "expected a dense float weight with a bias".into(),
        });
    };
    Ok((weight, bias))
}

fn dense(
    weights: &mut WeightMap,
    prefix: &str,
    out: usize,
    input: usize,
) -> Result<Dense, LoadError> {
    let (weight, bias) = linear(weights, prefix, out, input)?;
    Dense::new(weight, bias).map_err(mlx)
}

fn norm(weights: &mut WeightMap, prefix: &str, size: usize) -> Result<Norm, LoadError> {
    Ok(Norm {
        weight: weights.vector(&format!("{prefix}.weight"), size, 0.0)?,
        bias: weights.vector(&format!("{prefix}.bias"), size, 0.0)?,
    })
}

fn mlx(e: mlx_rs::error::Exception) -> LoadError {
    LoadError::Mlx(e.to_string())
}
