//! Model files -> a runnable [`Transformer`]: GGUF (through MLX's loader, or
//! our own reader for tensor types MLX lacks) or Hugging Face / mlx-community
//! directories (safetensors + config.json).

pub mod config;
pub mod gguf;
pub mod kv_cache;
mod summary;
pub mod transformer;
pub mod weights;

use std::path::{Path, PathBuf};

use mlx_rs::Dtype;
use mlx_rs::io::GgufFile;

pub use config::{Family, ModelConfig};
pub use gguf::{GgufMetadata, GgufReader, LayoutTarget};
pub use kv_cache::KvCache;
pub use summary::{ModelFileError, ModelSummary, model_id};
pub use transformer::Transformer;
use weights::WeightMap;

/// Why a model could not be loaded. Each message names the file or tensor.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum LoadError {
    #[error("{0}: {1}")]
    Io(PathBuf, String),
    #[error("{0} is neither a .gguf file nor a directory with config.json")]
    UnknownFormat(PathBuf),
    #[error("model config lacks `{0}`")]
    MissingConfig(&'static str),
    #[error("architecture `{0}` is not supported (supported: llama, qwen2, qwen3, gemma3)")]
    UnsupportedArchitecture(String),
    #[error("tensor `{0}` is missing from the weights")]
    MissingTensor(String),
    #[error("tensor `{name}` does not match the config: {detail}")]
    ShapeMismatch { name: String, detail: String },
    #[error("MLX: {0}")]
    Mlx(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// The float dtype weights and activations run in, chosen once per process:
/// f32 on MLX's CPU backend, where half-precision math is ~30x slower (and
/// the f16 -> f32 cast is exact); on a GPU bf16 by default (as mlx-lm runs
/// there: half the bytes a decode step reads), or what `MLXGATE_DTYPE`
/// (`float32`, `bfloat16`, `float16`) asks for.
pub fn compute_dtype() -> Dtype {
    static DTYPE: std::sync::OnceLock<Dtype> = std::sync::OnceLock::new();
    *DTYPE.get_or_init(|| {
        let gpu = crate::mlx::Backend::detect() != crate::mlx::Backend::Cpu;
        let asked = std::env::var("MLXGATE_DTYPE").ok();
        match choose_dtype(gpu, asked.as_deref()) {
            Ok(dtype) => dtype,
            Err(why) => {
                tracing::warn!("{why}");
                choose_dtype(gpu, None).unwrap_or(Dtype::Float32)
            }
        }
    })
}

/// `compute_dtype`'s rule, apart from the process it runs in.
fn choose_dtype(gpu: bool, asked: Option<&str>) -> Result<Dtype, String> {
    let default = if gpu { Dtype::Bfloat16 } else { Dtype::Float32 };
    let Some(asked) = asked.filter(|a| !a.is_empty()) else {
        return Ok(default);
    };
    let dtype = match asked {
        "float32" | "f32" => Dtype::Float32,
        "bfloat16" | "bf16" => Dtype::Bfloat16,
        "float16" | "f16" => Dtype::Float16,
        other => {
            return Err(format!(
                "MLXGATE_DTYPE=`{other}` is not one of float32, bfloat16, float16: using {}",
                crate::engine::prompt_cache::tensors::dtype_name(default)
            ));
        }
    };
    if !gpu && dtype != Dtype::Float32 {
        return Err(format!(
            "MLXGATE_DTYPE={asked} is for GPU backends: MLX's CPU backend runs float32 (half precision is ~30x slower there, and the native kernels take float32)"
        ));
    }
    Ok(dtype)
}

/// Loads a GGUF file's transformer. The tokenizer is built separately from the
/// same file's metadata.
///
/// Files whose tensors are all of types MLX reads natively go through MLX's
/// loader (fastest: Q4_0/Q4_1/Q8_0 arrive already in MLX's layout); others
/// (K-quants, Q5_x, BF16) through our reader, which requantizes.
pub fn load_gguf(path: &Path, reader: &GgufReader) -> Result<Transformer, LoadError> {
    let config = gguf_config(reader)?;
    let mut weights = gguf_weights(path, reader, LayoutTarget::for_this_process())?;
    let model = Transformer::build(config, &mut weights, true)?;
    report_leftovers(path, &weights);
    Ok(model)
}

/// This rank's part of a GGUF model split over `world` processes: each
/// tensor is cut to the rank's slice as it is read (always through our
/// reader, whose layouts equal MLX's loader's for the types both read), so
/// the rank never holds the whole model.
pub fn load_gguf_shard(
    path: &Path,
    reader: &GgufReader,
    rank: usize,
    world: usize,
) -> Result<Transformer, LoadError> {
    use crate::engine::distributed::plan::ShardPlan;
    use crate::engine::distributed::shard::TensorShard;
    let config = gguf_config(reader)?;
    let target = LayoutTarget::for_this_process();
    // The plan a whole load would make: column groups of o and down.
    let group_of = |name: &str| {
        reader
            .tensors()
            .iter()
            .find(|t| t.name == name)
            .and_then(|t| gguf::mlx_quantization(t.kind, target))
            .map_or(0, |layout| layout.group_size as usize)
    };
    let plan = ShardPlan::for_load(
        &config,
        rank,
        world,
        group_of("blk.0.attn_output.weight"),
        group_of("blk.0.ffn_down.weight"),
    )?;
    let shard = TensorShard {
        plan: &plan,
        config: &config,
    };
    let mut weights = gguf::weight_map_sliced(reader, compute_dtype(), target, &mut |name, a| {
        let kept = shard.keep(name, a)?;
        // The whole tensor is freed; MLX would keep its buffer for reuse,
        // and the rank would come to hold the whole model after all.
        mlx_rs::memory::clear_cache()?;
        Ok(kept)
    })?;
    let model = Transformer::build(plan.local_config(&config), &mut weights, true)?;
    report_leftovers(path, &weights);
    Ok(model.with_plan(plan))
}

/// A GGUF file's tensors under HF names: through MLX's loader when it reads
/// every tensor type natively, else through our reader (which carries
/// quantized blocks over exactly where `target` takes them, else
/// requantizes).
pub fn gguf_weights(
    path: &Path,
    reader: &GgufReader,
    target: LayoutTarget,
) -> Result<WeightMap, LoadError> {
    if reader.mlx_can_load() {
        let file =
            GgufFile::load(path).map_err(|e| LoadError::Io(path.to_owned(), e.to_string()))?;
        WeightMap::from_gguf(&file, compute_dtype())
    } else {
        gguf::weight_map(reader, compute_dtype(), target)
    }
}

/// Loads an HF / mlx-community directory's transformer.
pub fn load_hf_dir(dir: &Path) -> Result<Transformer, LoadError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| LoadError::Io(config_path.clone(), e.to_string()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| LoadError::Io(config_path.clone(), e.to_string()))?;
    let config = ModelConfig::from_hf_json(&json)?;
    let mut weights = WeightMap::from_safetensors_dir(dir, compute_dtype())?;
    let model = Transformer::build(config, &mut weights, false)?;
    report_leftovers(dir, &weights);
    Ok(model)
}

fn report_leftovers(path: &Path, weights: &WeightMap) {
    let leftovers = weights.leftovers();
    if !leftovers.is_empty() {
        tracing::warn!(path = %path.display(), unused = ?leftovers, "tensors not used by the model");
    }
}

/// Reads the architecture facts from GGUF metadata (`{arch}.*` keys), through
/// MLX's loader or our reader alike.
pub fn gguf_config(file: &(impl GgufMetadata + ?Sized)) -> Result<ModelConfig, LoadError> {
    let arch = file
        .meta_string("general.architecture")?
        .ok_or(LoadError::MissingConfig("general.architecture"))?;
    let family =
        Family::from_name(&arch).ok_or_else(|| LoadError::UnsupportedArchitecture(arch.clone()))?;
    let number = |key: &str| file.meta_number(&format!("{arch}.{key}"));
    let required = |key: &'static str| -> Result<usize, LoadError> {
        number(key)?
            .map(|v| v as usize)
            .ok_or(LoadError::MissingConfig(key))
    };
    let hidden_size = required("embedding_length")?;
    let heads = required("attention.head_count")?;
    let vocab_size = match number("vocab_size")? {
        Some(v) => v as usize,
        None => file
            .meta_strings("tokenizer.ggml.tokens")?
            .map_or(0, |t| t.len()),
    };
    let head_dim = number("attention.key_length")?.map_or(hidden_size / heads, |v| v as usize);
    let is_gemma = family == Family::Gemma3;
    let rope_scale = match file
        .meta_string(&format!("{arch}.rope.scaling.type"))?
        .as_deref()
    {
        Some("linear") => number("rope.scaling.factor")?.map_or(1.0, |f| 1.0 / f as f32),
        _ => 1.0,
    };
    Ok(ModelConfig {
        family,
        hidden_size,
        intermediate_size: required("feed_forward_length")?,
        layers: required("block_count")?,
        heads,
        kv_heads: number("attention.head_count_kv")?.map_or(heads, |v| v as usize),
        head_dim,
        vocab_size,
        context_length: number("context_length")?.map_or(4096, |v| v as usize),
        rms_norm_eps: number("attention.layer_norm_rms_epsilon")?.map_or(1e-6, |v| v as f32),
        rope_theta: number("rope.freq_base")?.map_or(10000.0, |v| v as f32),
        rope_local_theta: 10000.0,
        rope_scale,
        // llama.cpp permutes llama q/k rows for the interleaved rotary layout;
        // qwen and gemma GGUFs keep the half-split (NeoX) layout.
        rope_traditional: family == Family::Llama,
        tie_word_embeddings: true,
        sliding_window: if is_gemma {
            number("attention.sliding_window")?.map(|v| v as usize)
        } else {
            None
        },
        sliding_window_pattern: 6,
        // GGUF has no key for it: Gemma 3 uses head_dim (256 for 270M to
        // 12B) except the 27B (62 layers), trained with hidden / heads = 168.
        query_pre_attn_scalar: match (is_gemma, required("block_count")?) {
            (true, 62) => Some((hidden_size / heads) as f32),
            (true, _) => Some(head_dim as f32),
            (false, _) => None,
        },
        // llama.cpp's converter stores Gemma norms as 1 + w (checked: the
        // 270M GGUF's logits match mlx-lm's gemma3_text, which adds the 1).
        norm_weight_offset: 0.0,
        quantization: None,
    })
}

#[cfg(test)]
mod dtype_tests {
    use super::*;

    #[test]
    fn cpu_runs_float32_and_gpus_bfloat16_unless_asked() {
        assert_eq!(choose_dtype(false, None), Ok(Dtype::Float32));
        assert_eq!(choose_dtype(true, None), Ok(Dtype::Bfloat16));
        assert_eq!(choose_dtype(true, Some("float32")), Ok(Dtype::Float32));
        assert_eq!(choose_dtype(true, Some("f16")), Ok(Dtype::Float16));
        assert_eq!(choose_dtype(false, Some("float32")), Ok(Dtype::Float32));
        let err = choose_dtype(false, Some("bfloat16")).unwrap_err();
        assert!(err.contains("CPU backend runs float32"), "{err}");
        let err = choose_dtype(true, Some("fp8")).unwrap_err();
        assert!(
            err.contains("not one of float32, bfloat16, float16"),
            "{err}"
        );
    }
}
