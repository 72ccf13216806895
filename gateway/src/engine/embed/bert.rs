//! BERT-family encoders (absolute positions, post-norm, GELU), the models
//! sentence-transformers builds on, as one MLX graph per padded batch.
//!
//! Tokens run as rows: the hidden state is `[batch * length, hidden]`, so
//! every projection is one GEMM (`addmm`, bias fused) over the whole batch;
//! only attention sees the `[batch, heads, length, head_dim]` shape, where
//! padded keys are masked out.

use std::path::Path;

use mlx_rs::fast::{ScaledDotProductAttentionMask, layer_norm, scaled_dot_product_attention};
use mlx_rs::ops::{add, addmm, concatenate};
use mlx_rs::{Array, Dtype};

use crate::engine::model::LoadError;
use crate::engine::model::weights::{Kernel, MlxResult, WeightMap};

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

/// `y = x W^T + b` with the transpose taken once at load.
struct Dense {
    weight_t: Array,
    bias: Array,
}

impl Dense {
    fn forward(&self, x: &Array) -> MlxResult<Array> {
        addmm(&self.bias, x, &self.weight_t, None, None)
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
            let q = dense(&mut weights, &format!("{at}.attention.self.query"), h, h)?;
            let k = dense(&mut weights, &format!("{at}.attention.self.key"), h, h)?;
            let v = dense(&mut weights, &format!("{at}.attention.self.value"), h, h)?;
            let qkv = Dense {
                weight_t: concatenate(&[q.weight_t, k.weight_t, v.weight_t], 1).map_err(mlx)?,
                bias: concatenate(&[q.bias, k.bias, v.bias], 0).map_err(mlx)?,
            };
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

    fn arrays(&self) -> Vec<&Array> {
        let mut all = vec![&self.words, &self.positions, &self.segment];
        all.extend([&self.embedding_norm.weight, &self.embedding_norm.bias]);
        for l in &self.layers {
            for d in [&l.qkv, &l.attention_out, &l.intermediate, &l.output] {
                all.extend([&d.weight_t, &d.bias]);
            }
            for n in [&l.attention_norm, &l.output_norm] {
                all.extend([&n.weight, &n.bias]);
            }
        }
        all
    }

    /// The last layer's hidden states, `[batch * length, hidden]`, of
    /// `ids` (`batch` rows of `length` ids, right-padded); `lengths[b]` is
    /// row `b`'s real length, and no position attends past it.
    pub fn forward(&self, ids: &[u32], lengths: &[usize], length: usize) -> MlxResult<Array> {
        let c = &self.config;
        let (batch, h) = (lengths.len() as i32, c.hidden_size as i32);
        let (heads, head_dim) = (c.heads as i32, (c.hidden_size / c.heads) as i32);
        let len = length as i32;
        let tokens = Array::from_slice(ids, &[batch * len]);
        let position_ids: Vec<u32> = (0..batch as u32).flat_map(|_| 0..len as u32).collect();
        let positions = Array::from_slice(&position_ids, &[batch * len]);
        let embedded = add(
            add(
                self.words.take_axis(&tokens, 0)?,
                self.positions.take_axis(&positions, 0)?,
            )?,
            &self.segment,
        )?;
        let mut x = self.embedding_norm.apply(&embedded, c.layer_norm_eps)?;
        let mask = key_mask(lengths, length);
        let scale = 1.0 / (head_dim as f32).sqrt();
        for layer in &self.layers {
            let qkv = layer
                .qkv
                .forward(&x)?
                .reshape(&[batch, len, 3, heads, head_dim])?;
            // [3, batch, heads, length, head_dim]
            let qkv = qkv.transpose_axes(&[2, 0, 3, 1, 4])?;
            let part = |i: i32| qkv.take_axis(Array::from_int(i), 0);
            let mask = ScaledDotProductAttentionMask::Array(&mask);
            let attended = scaled_dot_product_attention(
                part(0)?,
                part(1)?,
                part(2)?,
                scale,
                Some(mask),
                None,
            )?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[batch * len, h])?;
            let attended = layer.attention_out.forward(&attended)?;
            x = layer
                .attention_norm
                .apply(&add(&attended, &x)?, c.layer_norm_eps)?;
            let inner = c.activation.apply(&layer.intermediate.forward(&x)?)?;
            let out = layer.output.forward(&inner)?;
            x = layer.output_norm.apply(&add(&out, &x)?, c.layer_norm_eps)?;
        }
        Ok(x)
    }
}

impl Activation {
    fn apply(self, x: &Array) -> MlxResult<Array> {
        match self {
            Activation::Gelu => mlx_rs::nn::gelu(x),
            Activation::GeluTanh => mlx_rs::nn::gelu_approximate(x),
            Activation::Relu => mlx_rs::nn::relu(x),
        }
    }
}

impl Norm {
    fn apply(&self, x: &Array, eps: f32) -> MlxResult<Array> {
        layer_norm(x, &self.weight, &self.bias, eps)
    }
}

/// An additive `[batch, 1, 1, length]` mask: 0 for each row's real keys, a
/// very negative number for its padding (softmax gives those no weight).
fn key_mask(lengths: &[usize], length: usize) -> Array {
    let values: Vec<f32> = lengths
        .iter()
        .flat_map(|&n| (0..length).map(move |i| if i < n { 0.0 } else { f32::MIN }))
        .collect();
    Array::from_slice(&values, &[lengths.len() as i32, 1, 1, length as i32])
}

fn dense(
    weights: &mut WeightMap,
    prefix: &str,
    out: usize,
    input: usize,
) -> Result<Dense, LoadError> {
    let linear = weights.linear(prefix, out, input)?;
    let (Kernel::Dense(weight), Some(bias)) = (linear.kernel, linear.bias) else {
        return Err(LoadError::ShapeMismatch {
            name: format!("{prefix}.weight"),
            detail: "expected a dense float weight with a bias".into(),
        });
    };
    // Contiguous `[in, out]`, so each GEMM reads it without a transpose.
    let weight_t = weight.t().contiguous().map_err(mlx)?;
    Ok(Dense { weight_t, bias })
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
