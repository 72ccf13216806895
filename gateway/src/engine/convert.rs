//! `mlxgate convert`: a GGUF file -> an mlx-community style directory
//! (`config.json`, `model.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`) that mlxgate and Python `mlx-lm` both load.
//!
//! What changes on the way:
//! * tensor names: llama.cpp's -> Hugging Face's;
//! * llama q/k rows: llama.cpp permutes them for its interleaved RoPE; HF
//!   layout (half-split RoPE) needs them back, on weight, scales and biases alike;
//! * quantized tensors stay in MLX's affine layout (optionally requantized),
//!   with float32 scales/biases (exact from GGUF's f16; fast on MLX's CPU);
//! * Gemma norms: GGUF stores `1 + w`, HF stores `w`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx_rs::ops::quantize;
use mlx_rs::{Array, Dtype};
use serde_json::{Value, json};

use super::model::weights::Kernel;
use super::model::{
    Family, GgufReader, LayoutTarget, LoadError, ModelConfig, gguf_config, gguf_weights,
};
use super::text::TextCodec;

/// Requantization wanted by `--quantize` / `--group-size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requantize {
    pub bits: i32,
    pub group_size: i32,
}

/// What a conversion did, for the CLI to print.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub output: PathBuf,
    pub tensors: usize,
    pub quantized: usize,
    pub bytes: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("writing {0}: {1}")]
    Write(PathBuf, String),
    #[error(
        "--quantize must be 4 or 8 and --group-size 32 or 64 (got {bits} bits, group {group_size})"
    )]
    BadQuantization { bits: i32, group_size: i32 },
}

/// Converts `input` (GGUF) into the directory `output` (created).
pub fn convert_gguf(
    input: &Path,
    output: &Path,
    requantize: Option<Requantize>,
) -> Result<ConvertReport, ConvertError> {
    if let Some(Requantize { bits, group_size }) = requantize
        && (![4, 8].contains(&bits) || ![32, 64].contains(&group_size))
    {
        return Err(ConvertError::BadQuantization { bits, group_size });
    }
    let reader =
        GgufReader::open(input).map_err(|e| LoadError::Io(input.to_owned(), e.to_string()))?;
    let config = gguf_config(&reader)?;
    let codec = TextCodec::for_gguf_file(input, &reader)?;
    let (tensors, plain) = collect_tensors(
        gguf_weights(input, &reader, LayoutTarget::Mlx)?.into_tensors(),
        &config,
    )?;

    let mut arrays: BTreeMap<String, Array> = BTreeMap::new();
    for (name, array) in plain {
        arrays.insert(name, array.as_dtype(Dtype::Float32)?);
    }
    let tensor_count = tensors.len();
    let converted = requantized_tensors(tensors, requantize)?;
    let main_quantization = most_common_quantization(&converted);
    let (overrides, quantized) = add_tensors(&mut arrays, converted, main_quantization)?;
    write_weights(output, &arrays)?;

    let mut config_json = hf_config(&config, &codec);
    if let Some((group_size, bits)) = main_quantization {
        let mut quantization = serde_json::Map::from_iter([
            ("group_size".to_owned(), json!(group_size)),
            ("bits".to_owned(), json!(bits)),
        ]);
        quantization.extend(overrides);
        config_json["quantization"] = Value::Object(quantization);
    }
    write_json(&output.join("config.json"), &config_json)?;
    codec
        .save(output)
        .map_err(|e| ConvertError::Write(output.to_owned(), e))?;
    let bytes = arrays.values().map(Array::nbytes).sum();
    Ok(ConvertReport {
        output: output.to_owned(),
        tensors: tensor_count,
        quantized,
        bytes,
    })
}

/// The tensors as they are written: quantized ones (and dense linear
/// weights) requantized to `requantize` when given, the rest unchanged.
fn requantized_tensors(
    tensors: BTreeMap<String, Kernel>,
    requantize: Option<Requantize>,
) -> Result<Vec<(String, Kernel)>, ConvertError> {
    let mut converted = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        let tensor = match requantize {
            Some(target)
                if tensor.quantization().is_some()
                    || matches!(&tensor, Kernel::Dense(a) if is_linear(&name, a, target.group_size)) =>
            {
                requantized(&tensor.dense()?, target)?
            }
            _ => tensor,
        };
        converted.push((name, tensor));
    }
    Ok(converted)
}

/// The most common `(group size, bits)` of the quantized tensors: the
/// directory-wide setting; the rest become mlx-lm's per-module overrides.
fn most_common_quantization(tensors: &[(String, Kernel)]) -> Option<(i32, i32)> {
    let mut settings: BTreeMap<(i32, i32), usize> = BTreeMap::new();
    for setting in tensors
        .iter()
        .filter_map(|(_, tensor)| tensor.quantization())
    {
        *settings.entry(setting).or_default() += 1;
    }
    settings
        .iter()
        .max_by_key(|(_, count)| **count)
        .map(|(setting, _)| *setting)
}

/// Adds each tensor's arrays (`{name}.weight`, and `.scales` / `.biases`
/// when quantized) to `arrays`; returns mlx-lm's per-module overrides of
/// the tensors quantized otherwise than `main_quantization`, and how many
/// tensors are quantized.
fn add_tensors(
    arrays: &mut BTreeMap<String, Array>,
    tensors: Vec<(String, Kernel)>,
    main_quantization: Option<(i32, i32)>,
) -> Result<(serde_json::Map<String, Value>, usize), ConvertError> {
    let mut overrides = serde_json::Map::new();
    let mut quantized = 0;
    for (name, tensor) in tensors {
        match tensor {
            Kernel::Dense(array) => {
                arrays.insert(format!("{name}.weight"), array.as_dtype(Dtype::Float32)?);
            }
            Kernel::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => {
                quantized += 1;
                if Some((group_size, bits)) != main_quantization {
                    overrides.insert(
                        name.clone(),
                        json!({"group_size": group_size, "bits": bits}),
                    );
                }
                arrays.insert(format!("{name}.weight"), weight);
                arrays.insert(format!("{name}.scales"), scales.as_dtype(Dtype::Float32)?);
                arrays.insert(format!("{name}.biases"), biases.as_dtype(Dtype::Float32)?);
            }
        }
    }
    Ok((overrides, quantized))
}

/// Writes `arrays` as `output/model.safetensors`, creating `output`.
fn write_weights(output: &Path, arrays: &BTreeMap<String, Array>) -> Result<(), ConvertError> {
    std::fs::create_dir_all(output)
        .map_err(|e| ConvertError::Write(output.to_owned(), e.to_string()))?;
    let weights_path = output.join("model.safetensors");
    let metadata = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
    Array::save_safetensors(
        arrays.iter().map(|(k, v)| (k.as_str(), v)),
        &metadata,
        &weights_path,
    )
    .map_err(|e| ConvertError::Write(weights_path.clone(), e.to_string()))
}

/// GGUF arrays grouped into tensors under HF module names, fixed up for HF layout.
/// Tensors by module name (written as `{module}.weight` ...) and the
/// remaining plain arrays (such as linear biases) by full name.
type Collected = (BTreeMap<String, Kernel>, BTreeMap<String, Array>);

fn collect_tensors(
    mut raw: HashMap<String, Array>,
    config: &ModelConfig,
) -> Result<Collected, ConvertError> {
    let modules: Vec<String> = raw
        .keys()
        .filter_map(|k| k.strip_suffix(".weight"))
        .map(str::to_owned)
        .collect();
    let mut tensors = BTreeMap::new();
    for module in modules {
        let weight = raw
            .remove(&format!("{module}.weight"))
            .expect("listed above");
        let module = hf_module_name(&module, config.family);
        let tensor = match (
            raw.remove(&format!("{module}.scales")),
            raw.remove(&format!("{module}.biases")),
        ) {
            (Some(scales), Some(biases)) => {
                let input = scales.shape()[1] as usize * 32;
                // GGUF's MLX-native types all use groups of 32.
                let bits = (weight.shape()[1] as usize * 32 / input) as i32;
                Kernel::Quantized {
                    weight,
                    scales,
                    biases,
                    group_size: 32,
                    bits,
                }
            }
            _ => Kernel::Dense(weight),
        };
        let tensor = match config.family {
            Family::Llama if module.ends_with("q_proj") => unpermute(tensor, config.heads)?,
            Family::Llama if module.ends_with("k_proj") => unpermute(tensor, config.kv_heads)?,
            Family::Gemma3 if module.ends_with("norm") => match tensor {
                Kernel::Dense(w) => Kernel::Dense(mlx_rs::ops::subtract(&w, Array::from_f32(1.0))?),
                other => other,
            },
            _ => tensor,
        };
        tensors.insert(module, tensor);
    }
    // What is left are plain arrays such as qwen2's linear biases.
    Ok((tensors, raw.into_iter().collect()))
}

/// Gemma's GGUF norm names differ from llama's (see `Transformer::build`).
fn hf_module_name(module: &str, family: Family) -> String {
    if family != Family::Gemma3 {
        return module.to_owned();
    }
    if let Some(prefix) = module.strip_suffix(".gemma_post_attention_layernorm") {
        format!("{prefix}.post_attention_layernorm")
    } else if let Some(prefix) = module.strip_suffix(".post_attention_layernorm") {
        format!("{prefix}.pre_feedforward_layernorm")
    } else {
        module.to_owned()
    }
}

/// Undoes llama.cpp's q/k row permutation: rows are (head, half, i) in HF
/// order and (head, i, half) in GGUF order.
fn unpermute(tensor: Kernel, heads: usize) -> Result<Kernel, ConvertError> {
    Ok(tensor.map_rows(|array| {
        let shape = array.shape();
        let (out, cols) = (shape[0], shape[1]);
        let half = out / heads as i32 / 2;
        array
            .reshape(&[heads as i32, half, 2, cols])?
            .swap_axes(1, 2)?
            .reshape(&[out, cols])
    })?)
}

fn is_linear(name: &str, array: &Array, group_size: i32) -> bool {
    array.ndim() == 2 && !name.contains("norm") && array.shape()[1] % group_size == 0
}

fn requantized(dense: &Array, target: Requantize) -> Result<Kernel, ConvertError> {
    let (weight, scales, biases) = quantize(
        dense.as_dtype(Dtype::Float32)?,
        target.group_size,
        target.bits,
    )?;
    Ok(Kernel::Quantized {
        weight,
        scales,
        biases,
        group_size: target.group_size,
        bits: target.bits,
    })
}

fn hf_config(config: &ModelConfig, codec: &TextCodec) -> Value {
    let (class, model_type) = match config.family {
        Family::Llama => ("LlamaForCausalLM", "llama"),
        Family::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Family::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        Family::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
    };
    let mut value = json!({
        "architectures": [class],
        "model_type": model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": codec.eos_ids,
    });
    if config.family == Family::Gemma3 {
        value["sliding_window"] = json!(config.sliding_window);
        value["sliding_window_pattern"] = json!(config.sliding_window_pattern);
        value["rope_local_base_freq"] = json!(config.rope_local_theta);
        // transformers validates this field as an integer.
        value["query_pre_attn_scalar"] =
            json!(config.query_pre_attn_scalar.map(|v| v.round() as i64));
    }
    if config.rope_scale != 1.0 {
        value["rope_scaling"] = json!({"type": "linear", "factor": 1.0 / config.rope_scale});
    }
    value
}

fn write_json(path: &Path, value: &Value) -> Result<(), ConvertError> {
    let text = serde_json::to_string_pretty(value).expect("JSON values serialise");
    std::fs::write(path, text).map_err(|e| ConvertError::Write(path.to_owned(), e.to_string()))
}
