//! A model file loaded through MLX, summarised (what `/readyz` and `doctor` need).

use std::path::{Path, PathBuf};

use mlx_rs::io::{GgufError, GgufFile};

use super::GgufReader;

/// Why a model file could not be loaded. Each variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ModelFileError {
    /// The path does not exist or is not a file.
    #[error(
        "model file {0} not found (run scripts/setup.sh to install the default model, or pass --model)"
    )]
    NotFound(PathBuf),
    /// Only GGUF files are understood so far.
    #[error("model file {0} is not a .gguf file")]
    UnsupportedFormat(PathBuf),
    /// MLX refused the file (corrupt, truncated or of an unsupported tensor type).
    #[error("MLX could not load {path}: {source}")]
    Mlx {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    /// Our own GGUF reader refused the file (files with tensor types MLX
    /// lacks, such as K-quants, are summarised through it).
    #[error("could not read {path}: {source}")]
    Gguf {
        path: PathBuf,
        #[source]
        source: super::gguf::GgufError,
    },
    /// The file loaded but lacks metadata every model needs.
    #[error("model file {path} has no `{key}` metadata")]
    MissingMetadata { path: PathBuf, key: &'static str },
}

/// The facts about a loaded model file that operators and readiness checks use.
#[derive(Debug, Clone)]
pub struct ModelSummary {
    /// Model id clients name in requests (the file stem without its quantization suffix).
    pub id: String,
    pub path: PathBuf,
    /// `general.architecture` (e.g. `llama`).
    pub architecture: String,
    /// Tensors in the file; a quantized tensor (weight + scales + biases) counts once.
    pub tensor_count: usize,
    /// Tensors MLX kept quantized (affine layout with `scales` and `biases`).
    pub quantized_count: usize,
    /// Bytes of all arrays as MLX holds them.
    pub bytes: usize,
}

impl ModelSummary {
    /// Loads `path` through MLX and summarises it. Blocking.
    pub fn load(path: &Path) -> Result<ModelSummary, ModelFileError> {
        if !path.is_file() {
            return Err(ModelFileError::NotFound(path.to_owned()));
        }
        if path.extension().is_none_or(|ext| ext != "gguf") {
            return Err(ModelFileError::UnsupportedFormat(path.to_owned()));
        }
        let mlx_error = |source| ModelFileError::Mlx {
            path: path.to_owned(),
            source,
        };
        let reader = GgufReader::open(path).map_err(|source| ModelFileError::Gguf {
            path: path.to_owned(),
            source,
        })?;
        if !reader.mlx_can_load() {
            return ModelSummary::from_reader(path, &reader);
        }
        let file = GgufFile::load(path).map_err(mlx_error)?;
        let architecture = file
            .get_metadata_string("general.architecture")
            .map_err(mlx_error)?
            .ok_or(ModelFileError::MissingMetadata {
                path: path.to_owned(),
                key: "general.architecture",
            })?;
        let arrays = file.arrays().map_err(mlx_error)?;
        let is_part = |key: &str| key.ends_with(".scales") || key.ends_with(".biases");
        let quantized_count = arrays.keys().filter(|key| key.ends_with(".scales")).count();
        let tensor_count = arrays.keys().filter(|key| !is_part(key)).count();
        let bytes = arrays.values().map(|array| array.nbytes()).sum();
        Ok(ModelSummary {
            id: model_id(path),
            path: path.to_owned(),
            architecture,
            tensor_count,
            quantized_count,
            bytes,
        })
    }
}

impl ModelSummary {
    /// For files MLX's loader rejects: counts from our reader's tensor table;
    /// `bytes` are the bytes as stored in the file.
    fn from_reader(path: &Path, reader: &GgufReader) -> Result<ModelSummary, ModelFileError> {
        let architecture = reader
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or(ModelFileError::MissingMetadata {
                path: path.to_owned(),
                key: "general.architecture",
            })?
            .to_owned();
        let tensors = reader.tensors();
        Ok(ModelSummary {
            id: model_id(path),
            path: path.to_owned(),
            architecture,
            tensor_count: tensors.len(),
            quantized_count: tensors.iter().filter(|t| !t.kind.is_float()).count(),
            bytes: tensors.iter().map(|t| t.size).sum(),
        })
    }
}

/// `SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`.
pub fn model_id(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    match stem.rsplit_once('.') {
        Some((name, quant)) if looks_like_quant_tag(quant) => name.to_owned(),
        _ => stem,
    }
}

fn looks_like_quant_tag(tag: &str) -> bool {
    let upper = tag.to_ascii_uppercase();
    ["Q", "F16", "F32", "BF16", "IQ"]
        .iter()
        .any(|prefix| upper.starts_with(prefix))
}

#[cfg(test)]
mod tests {
    use super::model_id;
    use std::path::Path;

    #[test]
    fn model_id_drops_the_quantization_suffix_only() {
        assert_eq!(
            model_id(Path::new("m/SmolLM2-135M-Instruct.Q4_1.gguf")),
            "SmolLM2-135M-Instruct"
        );
        assert_eq!(model_id(Path::new("gemma.F16.gguf")), "gemma");
        assert_eq!(model_id(Path::new("qwen2.5-coder.gguf")), "qwen2.5-coder");
        assert_eq!(model_id(Path::new("plain.gguf")), "plain");
    }
}
