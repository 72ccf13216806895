//! The architecture facts a forward pass needs, read from a Hugging Face
//! `config.json` or from GGUF metadata into one shape.

use serde_json::Value;

use super::LoadError;

/// Decoder families the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    pub fn from_name(name: &str) -> Option<Family> {
        match name {
            "llama" | "mistral" => Some(Family::Llama),
            "qwen2" => Some(Family::Qwen2),
            "qwen3" => Some(Family::Qwen3),
            "gemma3" | "gemma3_text" => Some(Family::Gemma3),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }
}

/// Everything about a model's shape and numerics the forward pass reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Gemma 3: the RoPE base of its sliding-window (local) layers.
    pub rope_local_theta: f32,
    /// Linear RoPE scaling factor (1 = none).
    pub rope_scale: f32,
    /// Interleaved (GPT-J) rotary layout: llama.cpp's permuted q/k rows in GGUF.
    pub rope_traditional: bool,
    pub tie_word_embeddings: bool,
    /// Gemma 3: window of the sliding layers and how often a global layer comes.
    pub sliding_window: Option<usize>,
    pub sliding_window_pattern: usize,
    /// Gemma 3 scales queries by `query_pre_attn_scalar^-0.5` instead of `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f32>,
    /// GGUF Gemma norms already hold `1 + w`; HF ones hold `w`.
    pub norm_weight_offset: f32,
    /// MLX affine quantization of an mlx-community checkpoint.
    pub quantization: Option<Quantization>,
}

/// Group size and bits of MLX affine-quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
}

impl ModelConfig {
    /// The factor queries are scaled by before attention.
    pub fn attention_scale(&self) -> f32 {
        match self.query_pre_attn_scalar {
            Some(scalar) => scalar.powf(-0.5),
            None => (self.head_dim as f32).powf(-0.5),
        }
    }

    /// The factor Gemma multiplies embeddings by: sqrt(hidden) rounded to
    /// bfloat16, as the reference implementations compute it (the exact root
    /// drifts). `None` for families that do not scale.
    pub fn embedding_scale(&self) -> Option<f32> {
        if self.family != Family::Gemma3 {
            return None;
        }
        // Round to nearest even on the upper 16 bits: f32 -> bf16 -> f32.
        let bits = (self.hidden_size as f32).sqrt().to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
        Some(f32::from_bits(rounded))
    }

    /// Is layer `layer` a sliding-window (local attention) layer?
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some()
            && self.sliding_window_pattern > 0
            && !(layer + 1).is_multiple_of(self.sliding_window_pattern)
    }

    /// Reads a Hugging Face / mlx-community `config.json`.
    pub fn from_hf_json(config: &Value) -> Result<ModelConfig, LoadError> {
        // Multimodal checkpoints keep the language model's settings in `text_config`.
        let text = config.get("text_config").unwrap_or(config);
        let model_type = str_field(text, "model_type")
            .or_else(|| str_field(config, "model_type"))
            .ok_or(LoadError::MissingConfig("model_type"))?;
        let family = Family::from_name(&model_type)
            .ok_or_else(|| LoadError::UnsupportedArchitecture(model_type.clone()))?;
        let hidden_size = required_count(text, "hidden_size")?;
        let heads = required_count(text, "num_attention_heads")?;
        let head_dim = count_or(text, "head_dim", hidden_size / heads);
        let is_gemma = family == Family::Gemma3;
        Ok(ModelConfig {
            family,
            hidden_size,
            intermediate_size: required_count(text, "intermediate_size")?,
            layers: required_count(text, "num_hidden_layers")?,
            heads,
            kv_heads: count_or(text, "num_key_value_heads", heads),
            head_dim,
            vocab_size: required_count(text, "vocab_size")?,
            context_length: count_or(text, "max_position_embeddings", 4096),
            rms_norm_eps: float_or(text, "rms_norm_eps", 1e-6),
            rope_theta: text
                .get("rope_theta")
                .or_else(|| text.get("rope_parameters")?.get("rope_theta"))
                .and_then(Value::as_f64)
                .map_or(10000.0, |v| v as f32),
            rope_local_theta: float_or(text, "rope_local_base_freq", 10000.0),
            rope_scale: linear_rope_scale(text),
            rope_traditional: false,
            tie_word_embeddings: text
                .get("tie_word_embeddings")
                .or(config.get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(is_gemma),
            sliding_window: if is_gemma {
                text.get("sliding_window")
                    .and_then(Value::as_u64)
                    .map(|v| v as usize)
            } else {
                None
            },
            sliding_window_pattern: count_or(text, "sliding_window_pattern", 6),
            query_pre_attn_scalar: if is_gemma {
                Some(float_or(text, "query_pre_attn_scalar", head_dim as f32))
            } else {
                None
            },
            norm_weight_offset: if is_gemma { 1.0 } else { 0.0 },
            quantization: hf_quantization(config),
        })
    }
}

/// A count `config.json` must give.
fn required_count(text: &Value, key: &'static str) -> Result<usize, LoadError> {
    text.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or(LoadError::MissingConfig(key))
}

/// A count `config.json` may give, else `default`.
fn count_or(text: &Value, key: &str, default: usize) -> usize {
    text.get(key)
        .and_then(Value::as_u64)
        .map_or(default, |v| v as usize)
}

/// A number `config.json` may give, else `default`.
fn float_or(text: &Value, key: &str, default: f32) -> f32 {
    text.get(key)
        .and_then(Value::as_f64)
        .map_or(default, |v| v as f32)
}

/// The RoPE position scale of `rope_scaling` (or, as transformers 5 writes
/// it, `rope_parameters`) when it is linear (`1 / factor`), else 1.
fn linear_rope_scale(text: &Value) -> f32 {
    text.get("rope_scaling")
        .or(text.get("rope_parameters"))
        .filter(|s| s.get("type").or(s.get("rope_type")).and_then(Value::as_str) == Some("linear"))
        .and_then(|s| s.get("factor"))
        .and_then(Value::as_f64)
        .map_or(1.0, |f| 1.0 / f as f32)
}

/// mlx-lm's `quantization` entry (group size and bits), when present.
fn hf_quantization(config: &Value) -> Option<Quantization> {
    let q = config.get("quantization")?;
    Some(Quantization {
        group_size: q.get("group_size")?.as_i64()? as i32,
        bits: q.get("bits")?.as_i64()? as i32,
    })
}

fn str_field(value: &Value, key: &str) -> Option<String> {
    value.get(key).and_then(Value::as_str).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rope_settings_are_read_where_transformers_5_writes_them() {
        let config = ModelConfig::from_hf_json(&json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}
        }))
        .unwrap();
        assert_eq!(config.rope_theta, 500000.0);
        assert_eq!(config.rope_scale, 0.25);
    }

    #[test]
    fn gemma_layers_alternate_local_and_global() {
        let config = ModelConfig::from_hf_json(&json!({
            "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 16, "vocab_size": 300, "sliding_window": 32, "sliding_window_pattern": 3
        }))
        .unwrap();
        let sliding: Vec<bool> = (0..6).map(|l| config.is_sliding(l)).collect();
        assert_eq!(sliding, [true, true, false, true, true, false]);
        assert!(config.tie_word_embeddings);
        assert_eq!(config.norm_weight_offset, 1.0);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let error = ModelConfig::from_hf_json(&json!({"model_type": "mamba"})).unwrap_err();
        assert!(error.to_string().contains("mamba"), "{error}");
    }
}
