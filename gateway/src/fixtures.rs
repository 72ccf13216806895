//! Tiny random-weight models written by code, so engine tests run in seconds
//! without committed blobs.
//!
//! A fixture is a Hugging Face style directory: `config.json`,
//! `model.safetensors` (f32), `tokenizer.json` (byte-level BPE with ChatML
//! special tokens) and `tokenizer_config.json` (with a ChatML `chat_template`).
//! Tensor names and config keys follow each architecture's `transformers`
//! conventions, so the same loader serves fixtures and real checkpoints.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use serde_json::{Value, json};

/// Architectures the fixture generator can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Architecture {
    pub const ALL: [Architecture; 4] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Gemma3,
    ];

    /// The `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3_text",
        }
    }

    fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
        }
    }
}

/// Sizes of a tiny model. The defaults give ~0.3 M parameters.
#[derive(Debug, Clone)]
pub struct TinyModelSpec {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    /// Gemma 3 only: the window of its sliding-attention layers.
    pub sliding_window: usize,
    /// Seeds the weights: the same spec always writes the same bytes.
    pub seed: u64,
}

impl TinyModelSpec {
    pub fn new(architecture: Architecture) -> Self {
        TinyModelSpec {
            architecture,
            hidden_size: 64,
            intermediate_size: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            max_position_embeddings: 512,
            sliding_window: 32,
            seed: 7,
        }
    }
}

/// Why a fixture could not be written.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error("writing fixture file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("serialising fixture weights: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
}

/// The special tokens every fixture tokenizer has, at ids 0, 1, 2.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A few merges so the BPE model is exercised beyond single bytes.
const MERGES: [(&str, &str); 8] = [
    ("h", "e"),
    ("Ġ", "t"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("Ġ", "a"),
    ("o", "u"),
    ("l", "l"),
];

/// Writes a tiny model for `spec` into `dir` (created if missing).
pub fn write_tiny_model(dir: &Path, spec: &TinyModelSpec) -> Result<(), FixtureError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| FixtureError::Io { path, source }
    };
    fs::create_dir_all(dir).map_err(io(dir))?;
    let (tokenizer, vocab_size) = tokenizer_json();
    let files = [
        ("config.json", config_json(spec, vocab_size)),
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config_json()),
    ];
    for (name, value) in files {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&value).expect("JSON values always serialise");
        fs::write(&path, text).map_err(io(&path))?;
    }

    let tensors = weights(spec, vocab_size);
    write_f32_safetensors(&dir.join("model.safetensors"), tensors)
}

/// Writes named f32 tensors as a safetensors file.
fn write_f32_safetensors(
    path: &Path,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
) -> Result<(), FixtureError> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, shape, values)| {
            (
                name,
                shape,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            let view = TensorView::new(Dtype::F32, shape.clone(), data)?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_owned(),
        "pt".to_owned(),
    )]));
    safetensors::serialize_to_file(views, metadata, path)?;
    Ok(())
}

/// A random LoRA adapter on all seven projections of every layer, in the
/// mlx-lm format, for a model of the given sizes.
#[derive(Debug, Clone)]
pub struct LoraSpec {
    pub layers: usize,
    pub hidden_size: usize,
    /// Heads x head_dim of queries, and of keys/values.
    pub q_dim: usize,
    pub kv_dim: usize,
    pub intermediate_size: usize,
    pub rank: usize,
    pub scale: f32,
    /// Factor values are uniform in [-amplitude, amplitude).
    pub amplitude: f32,
    pub seed: u64,
}

impl LoraSpec {
    /// Fits a tiny fixture model: rank 4, scale 4, factors up to 0.25.
    pub fn for_model(model: &TinyModelSpec) -> LoraSpec {
        LoraSpec {
            rank: 4,
            scale: 4.0,
            amplitude: 0.25,
            ..LoraSpec::shaped(
                model.layers,
                model.hidden_size,
                model.heads * model.head_dim,
                model.kv_heads * model.head_dim,
                model.intermediate_size,
            )
        }
    }

    /// Fits any loaded model: rank 8, on all seven projections of every layer.
    pub fn for_config(
        c: &crate::engine::model::ModelConfig,
        scale: f32,
        amplitude: f32,
    ) -> LoraSpec {
        LoraSpec {
            scale,
            amplitude,
            ..LoraSpec::shaped(
                c.layers,
                c.hidden_size,
                c.heads * c.head_dim,
                c.kv_heads * c.head_dim,
                c.intermediate_size,
            )
        }
    }

    /// Rank 8, scale 20, small factors (seed 1), for a model of these
    /// dimensions.
    fn shaped(
        layers: usize,
        hidden_size: usize,
        q_dim: usize,
        kv_dim: usize,
        intermediate_size: usize,
    ) -> LoraSpec {
        LoraSpec {
            layers,
            hidden_size,
            q_dim,
            kv_dim,
            intermediate_size,
            rank: 8,
            scale: 20.0,
            amplitude: 0.01,
            seed: 1,
        }
    }
}

/// Writes `adapters.safetensors` and `adapter_config.json` into `dir`.
pub fn write_random_lora(dir: &Path, spec: &LoraSpec) -> Result<(), FixtureError> {
    fs::create_dir_all(dir).map_err(|source| FixtureError::Io {
        path: dir.to_owned(),
        source,
    })?;
    let (h, q, kv, i) = (
        spec.hidden_size,
        spec.q_dim,
        spec.kv_dim,
        spec.intermediate_size,
    );
    let projections = [
        ("self_attn.q_proj", h, q),
        ("self_attn.k_proj", h, kv),
        ("self_attn.v_proj", h, kv),
        ("self_attn.o_proj", q, h),
        ("mlp.gate_proj", h, i),
        ("mlp.up_proj", h, i),
        ("mlp.down_proj", i, h),
    ];
    let mut rng = SplitMix64(spec.seed);
    let mut values =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.next_unit() * spec.amplitude).collect() };
    let mut tensors = Vec::new();
    for layer in 0..spec.layers {
        for (module, input, output) in projections {
            let name = format!("model.layers.{layer}.{module}");
            tensors.push((
                format!("{name}.lora_a"),
                vec![input, spec.rank],
                values(input * spec.rank),
            ));
            tensors.push((
                format!("{name}.lora_b"),
                vec![spec.rank, output],
                values(spec.rank * output),
            ));
        }
    }
    write_f32_safetensors(&dir.join("adapters.safetensors"), tensors)?;
    let config = json!({
        "fine_tune_type": "lora",
        "num_layers": spec.layers,
        "lora_parameters": {"rank": spec.rank, "scale": spec.scale, "dropout": 0.0},
    });
    let path = dir.join("adapter_config.json");
    fs::write(&path, config.to_string()).map_err(|source| FixtureError::Io { path, source })
}

fn config_json(spec: &TinyModelSpec, vocab_size: usize) -> Value {
    let mut config = json!({
        "architectures": [spec.architecture.class_name()],
        "model_type": spec.architecture.model_type(),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    });
    let extra = match spec.architecture {
        Architecture::Llama => json!({ "hidden_act": "silu", "attention_bias": false }),
        Architecture::Qwen2 => json!({ "hidden_act": "silu", "use_sliding_window": false }),
        Architecture::Qwen3 => json!({ "hidden_act": "silu", "attention_bias": false }),
        Architecture::Gemma3 => json!({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": spec.head_dim,
            "sliding_window": spec.sliding_window,
            "sliding_window_pattern": 2,
            "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": null,
            "attn_logit_softcapping": null,
        }),
    };
    if let (Value::Object(config), Value::Object(extra)) = (&mut config, extra) {
        config.extend(extra);
    }
    config
}

/// One (name, shape, values) per tensor, in the architecture's HF naming.
fn weights(spec: &TinyModelSpec, vocab_size: usize) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = SplitMix64(spec.seed);
    let (h, i) = (spec.hidden_size, spec.intermediate_size);
    let (q_dim, kv_dim) = (spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim);
    // Gemma multiplies RMSNorm weights as (1 + w): zero is its identity.
    let norm_value = if spec.architecture == Architecture::Gemma3 {
        0.0
    } else {
        1.0
    };
    let mut tensors = Vec::new();
    let mut random = |name: String, shape: Vec<usize>| {
        let count = shape.iter().product();
        let values = (0..count).map(|_| rng.next_unit() * 0.08).collect();
        (name, shape, values)
    };
    tensors.push(random(
        "model.embed_tokens.weight".into(),
        vec![vocab_size, h],
    ));
    let mut norms = vec![("model.norm.weight".to_owned(), h)];
    for layer in 0..spec.layers {
        let p = format!("model.layers.{layer}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![q_dim, h]),
            ("self_attn.k_proj.weight", vec![kv_dim, h]),
            ("self_attn.v_proj.weight", vec![kv_dim, h]),
            ("self_attn.o_proj.weight", vec![h, q_dim]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ] {
            tensors.push(random(format!("{p}.{name}"), shape));
        }
        if spec.architecture == Architecture::Qwen2 {
            for (name, size) in [("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)] {
                tensors.push(random(format!("{p}.self_attn.{name}.bias"), vec![size]));
            }
        }
        norms.push((format!("{p}.input_layernorm.weight"), h));
        norms.push((format!("{p}.post_attention_layernorm.weight"), h));
        if matches!(
            spec.architecture,
            Architecture::Qwen3 | Architecture::Gemma3
        ) {
            norms.push((format!("{p}.self_attn.q_norm.weight"), spec.head_dim));
            norms.push((format!("{p}.self_attn.k_norm.weight"), spec.head_dim));
        }
        if spec.architecture == Architecture::Gemma3 {
            norms.push((format!("{p}.pre_feedforward_layernorm.weight"), h));
            norms.push((format!("{p}.post_feedforward_layernorm.weight"), h));
        }
    }
    tensors.extend(
        norms
            .into_iter()
            .map(|(name, size)| (name, vec![size], vec![norm_value; size])),
    );
    tensors
}

/// A byte-level BPE `tokenizer.json`; returns it with its vocabulary size.
fn tokenizer_json() -> (Value, usize) {
    let mut vocab: BTreeMap<String, usize> = BTreeMap::new();
    for token in SPECIAL_TOKENS {
        let id = vocab.len();
        vocab.insert(token.to_owned(), id);
    }
    for byte in 0..=255u8 {
        let id = vocab.len();
        vocab.insert(byte_to_unicode(byte).to_string(), id);
    }
    for (left, right) in MERGES {
        let id = vocab.len();
        vocab.entry(format!("{left}{right}")).or_insert(id);
    }
    let vocab_size = vocab.len();
    let added_tokens: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({ "id": id, "content": content, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true })
        })
        .collect();
    let byte_level = json!({ "type": "ByteLevel", "add_prefix_space": false,
                             "trim_offsets": true, "use_regex": true });
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": MERGES.iter().map(|(l, r)| json!([l, r])).collect::<Vec<_>>(),
        }
    });
    (tokenizer, vocab_size)
}

fn tokenizer_config_json() -> Value {
    json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": false,
        "chat_template": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    })
}

/// GPT-2's reversible byte -> printable character map used by byte-level BPE.
pub fn byte_to_unicode(byte: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(byte) {
        return char::from(byte);
    }
    let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + shifted).expect("256..=323 are valid chars")
}

/// Small, fast, seedable generator; fixtures need reproducibility, not quality.
struct SplitMix64(u64);

impl SplitMix64 {
    /// Uniform in [-1, 1).
    fn next_unit(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_onto_printable_chars() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_to_unicode).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_to_unicode(b' '), 'Ġ');
        assert_eq!(byte_to_unicode(b'a'), 'a');
        assert!(chars.iter().all(|c| !c.is_whitespace() && !c.is_control()));
    }
}
