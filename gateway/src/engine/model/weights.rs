//! Weight files -> named MLX arrays in Hugging Face naming, and the layer
//! building blocks (`Linear`, `Embedding`) with their shapes checked against
//! the config.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::io::GgufFile;
use mlx_rs::ops::{dequantize, matmul, quantized_matmul};
use mlx_rs::{Array, Dtype};

use super::LoadError;
use crate::mlx::kernels::{self, PackedMatrix};

pub type MlxResult<T> = Result<T, mlx_rs::error::Exception>;

/// Tensors by name, taken out one by one while the model is assembled so
/// leftovers and gaps can be reported.
pub struct WeightMap {
    tensors: HashMap<String, Array>,
    /// Float dtype every float tensor is cast to (f32 on MLX's CPU backend,
    /// where half-precision math is ~30x slower).
    float_dtype: Dtype,
}

impl WeightMap {
    pub fn new(tensors: HashMap<String, Array>, float_dtype: Dtype) -> WeightMap {
        WeightMap {
            tensors,
            float_dtype,
        }
    }

    /// Reads every array of a GGUF file through MLX, renamed to HF names.
    pub fn from_gguf(file: &GgufFile, float_dtype: Dtype) -> Result<WeightMap, LoadError> {
        let arrays = file.arrays().map_err(|e| LoadError::Mlx(e.to_string()))?;
        let tensors = arrays
            .into_iter()
            .map(|(name, array)| (gguf_to_hf_name(&name).unwrap_or(name), array))
            .collect();
        Ok(WeightMap::new(tensors, float_dtype))
    }

    /// Reads every `*.safetensors` file in `dir`.
    pub fn from_safetensors_dir(dir: &Path, float_dtype: Dtype) -> Result<WeightMap, LoadError> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| LoadError::Io(dir.to_owned(), e.to_string()))?
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(LoadError::Io(
                dir.to_owned(),
                "no *.safetensors files".into(),
            ));
        }
        let mut tensors = HashMap::new();
        for file in files {
            let arrays = Array::load_safetensors(&file)
                .map_err(|e| LoadError::Io(file.clone(), e.to_string()))?;
            tensors.extend(arrays);
        }
        // mlx-community multimodal checkpoints prefix the text model.
        let tensors = tensors
            .into_iter()
            .map(|(name, array)| {
                (
                    name.strip_prefix("language_model.")
                        .map(str::to_owned)
                        .unwrap_or(name),
                    array,
                )
            })
            .collect();
        Ok(WeightMap::new(tensors, float_dtype))
    }

    /// All tensors as stored (no casts), for tools that rewrite a model.
    pub fn into_tensors(self) -> HashMap<String, Array> {
        self.tensors
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn take(&mut self, name: &str) -> Result<Array, LoadError> {
        self.tensors
            .remove(name)
            .ok_or_else(|| LoadError::MissingTensor(name.to_owned()))
    }

    fn float(&self, array: Array) -> Result<Array, LoadError> {
        if array.dtype() == self.float_dtype || !is_float(array.dtype()) {
            return Ok(array);
        }
        array
            .as_dtype(self.float_dtype)
            .map_err(|e| LoadError::Mlx(e.to_string()))
    }

    /// A vector of `size` values, such as a norm weight, plus `offset`.
    pub fn vector(&mut self, name: &str, size: usize, offset: f32) -> Result<Array, LoadError> {
        let array = self.take(name)?;
        check_shape(name, &array, &[size])?;
        let array = self.float(array)?;
        if offset == 0.0 {
            return Ok(array);
        }
        let shifted = mlx_rs::ops::add(&array, Array::from_f32(offset))
            .map_err(|e| LoadError::Mlx(e.to_string()))?;
        Ok(shifted)
    }

    /// `{prefix}.weight` (dense or MLX-affine quantized) and `{prefix}.bias` if present.
    pub fn linear(
        &mut self,
        prefix: &str,
        out_features: usize,
        in_features: usize,
    ) -> Result<Linear, LoadError> {
        let weight_name = format!("{prefix}.weight");
        let weight = self.take(&weight_name)?;
        let bias = match self.tensors.remove(&format!("{prefix}.bias")) {
            Some(bias) => {
                check_shape(&format!("{prefix}.bias"), &bias, &[out_features])?;
                Some(self.float(bias)?)
            }
            None => None,
        };
        let kernel = self.kernel(prefix, weight, out_features, in_features)?;
        Ok(Linear { kernel, bias })
    }

    fn kernel(
        &mut self,
        prefix: &str,
        weight: Array,
        out: usize,
        input: usize,
    ) -> Result<Kernel, LoadError> {
        let weight_name = format!("{prefix}.weight");
        let Some(scales) = self.tensors.remove(&format!("{prefix}.scales")) else {
            check_shape(&weight_name, &weight, &[out, input])?;
            return Ok(Kernel::Dense(self.float(weight)?));
        };
        let biases = self.take(&format!("{prefix}.biases"))?;
        // Group size and bits follow from the shapes: packed u32 words hold
        // `input * bits / 32` values' worth, and there is one scale per group.
        let (packed, groups) = (dim(&weight, 1), dim(&scales, 1));
        let bad = |what: String| LoadError::ShapeMismatch {
            name: weight_name.clone(),
            detail: what,
        };
        if weight.dtype() != Dtype::Uint32
            || dim(&weight, 0) != out
            || groups == 0
            || !input.is_multiple_of(groups)
        {
            return Err(bad(format!(
                "quantized weight {:?} {:?} with scales {:?} does not fit a [{out}, {input}] linear",
                weight.dtype(),
                weight.shape(),
                scales.shape()
            )));
        }
        let group_size = (input / groups) as i32;
        let bits = (packed * 32 / input) as i32;
        if packed * 32 % input != 0 || ![2, 3, 4, 5, 6, 8].contains(&bits) {
            return Err(bad(format!(
                "{packed} packed words per row is not a valid bit width for {input} inputs"
            )));
        }
        check_shape(
            &format!("{prefix}.biases"),
            &biases,
            scales
                .shape()
                .iter()
                .map(|&d| d as usize)
                .collect::<Vec<_>>()
                .as_slice(),
        )?;
        Ok(Kernel::Quantized {
            weight,
            scales: self.float(scales)?,
            biases: self.float(biases)?,
            group_size,
            bits,
        })
    }

    /// The token embedding table, `[vocab, hidden]`, dense or quantized.
    pub fn embedding(
        &mut self,
        name: &str,
        vocab: usize,
        hidden: usize,
    ) -> Result<Embedding, LoadError> {
        let prefix = name.strip_suffix(".weight").unwrap_or(name);
        let weight = self.take(name)?;
        Ok(Embedding {
            kernel: self.kernel(prefix, weight, vocab, hidden)?,
        })
    }

    /// Names never consumed: reported so a wrong mapping does not go unnoticed.
    pub fn leftovers(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }
}

fn is_float(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32 | Dtype::Float64
    )
}

fn dim(array: &Array, axis: usize) -> usize {
    array.shape().get(axis).copied().unwrap_or(0) as usize
}

fn check_shape(name: &str, array: &Array, expected: &[usize]) -> Result<(), LoadError> {
    let actual: Vec<usize> = array.shape().iter().map(|&d| d as usize).collect();
    if actual != expected {
        return Err(LoadError::ShapeMismatch {
            name: name.to_owned(),
            detail: format!("expected shape {expected:?}, found {actual:?}"),
        });
    }
    Ok(())
}

/// A weight matrix `[out, in]` as stored: dense, or MLX affine-quantized.
/// Clones share the arrays.
#[derive(Clone)]
pub enum Kernel {
    Dense(Array),
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        group_size: i32,
        bits: i32,
    },
}

impl Kernel {
    /// `x @ W^T`.
    fn apply(&self, x: &Array) -> MlxResult<Array> {
        match self {
            Kernel::Dense(weight) if kernels::decode_matmul_applies(x, weight) => {
                kernels::decode_matmul(x, weight)
            }
            Kernel::Dense(weight) => matmul(x, weight.t()),
            Kernel::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => {
                if kernels::quantized_matmul_is_native(x, scales, *group_size, *bits) {
                    kernels::quantized_matmul(x, weight, scales, biases, *group_size, *bits)
                } else if kernels::mlx_takes_group_size(*group_size) {
                    quantized_matmul(x, weight, scales, biases, true, *group_size, *bits)
                } else {
                    // Groups MLX's kernels lack (exact Q6_K), on a thread not
                    // running ours (`MLXGATE_KERNELS=mlx`, non-f32 inputs):
                    // correct but slow, the matrix is dequantized per call.
                    matmul(x, self.dense()?.t())
                }
            }
        }
    }

    /// The matrix as the native kernels read it outside MLX's graph (the
    /// native decode step); `None` when dense or in a layout they lack.
    /// `for_lookup`: read in place, for a table that only serves row lookups.
    pub fn packed(&self, for_lookup: bool) -> Option<PackedMatrix> {
        match self {
            Kernel::Dense(_) => None,
            Kernel::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => {
                let build = if for_lookup {
                    PackedMatrix::in_place
                } else {
                    PackedMatrix::new
                };
                build(weight, scales, biases, *group_size, *bits)
            }
        }
    }

    /// The stored arrays: the matrix, or packed weight, scales and biases.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Kernel::Dense(weight) => vec![weight],
            Kernel::Quantized {
                weight,
                scales,
                biases,
                ..
            } => vec![weight, scales, biases],
        }
    }

    /// `(group_size, bits)` when stored quantized.
    pub fn quantization(&self) -> Option<(i32, i32)> {
        match self {
            Kernel::Dense(_) => None,
            Kernel::Quantized {
                group_size, bits, ..
            } => Some((*group_size, *bits)),
        }
    }

    /// The same kernel with a row operation (a permutation of output rows)
    /// applied to every stored array: each has one row per output feature.
    pub fn map_rows(self, rows: impl Fn(&Array) -> MlxResult<Array>) -> MlxResult<Kernel> {
        Ok(match self {
            Kernel::Dense(weight) => Kernel::Dense(rows(&weight)?),
            Kernel::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => Kernel::Quantized {
                weight: rows(&weight)?,
                scales: rows(&scales)?,
                biases: rows(&biases)?,
                group_size,
                bits,
            },
        })
    }

    /// The dense matrix (dequantized when stored quantized).
    pub fn dense(&self) -> MlxResult<Array> {
        match self {
            Kernel::Dense(weight) => Ok(weight.clone()),
            Kernel::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => dequantize_affine(weight, scales, biases, *group_size, *bits),
        }
    }
}

/// `scale * code + bias` per group as floats: MLX's `dequantize` where it
/// takes the group size, else (groups of 16, 8-bit codes: exact Q6_K, which
/// only mlxgate's kernels multiply) one code per byte, scaled with plain ops
/// (a product and a sum, each rounded: within an ulp of the true value).
pub fn dequantize_affine(
    weight: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> MlxResult<Array> {
    if kernels::mlx_takes_group_size(group_size) || bits != 8 {
        return dequantize(weight, scales, biases, group_size, bits);
    }
    let mut grouped = scales.shape().to_vec();
    grouped.push(group_size);
    let mut dense = weight.shape().to_vec();
    if let Some(cols) = dense.last_mut() {
        *cols *= 4;
    }
    let codes = weight
        .view::<u8>()?
        .reshape(&grouped)?
        .as_dtype(scales.dtype())?;
    let scales = scales.expand_dims(-1)?;
    let biases = biases.expand_dims(-1)?;
    codes.multiply(&scales)?.add(&biases)?.reshape(&dense)
}

/// `y = x W^T + b`.
#[derive(Clone)]
pub struct Linear {
    pub kernel: Kernel,
    pub bias: Option<Array>,
}

impl Linear {
    pub fn forward(&self, x: &Array) -> MlxResult<Array> {
        let y = self.kernel.apply(x)?;
        match &self.bias {
            Some(bias) => mlx_rs::ops::add(&y, bias),
            None => Ok(y),
        }
    }

    /// `parts` as one projection, their output features one after another
    /// (evaluated), with each part then a view of its rows: one matmul where
    /// there were several, in the memory they took. `None` (nothing
    /// changed) where the parts are stored differently: dense and
    /// quantized, other bits or groups, other dtypes, a bias on some only.
    pub fn stack(parts: &mut [&mut Linear]) -> MlxResult<Option<Linear>> {
        let first = &parts[0];
        let alike = parts.iter().all(|p| {
            p.kernel.quantization() == first.kernel.quantization()
                && p.bias.is_some() == first.bias.is_some()
                && p.kernel
                    .arrays()
                    .iter()
                    .zip(first.kernel.arrays())
                    .all(|(a, b)| a.dtype() == b.dtype() && a.shape()[1..] == b.shape()[1..])
        });
        if !alike {
            return Ok(None);
        }
        let rows: Vec<i32> = parts
            .iter()
            .map(|p| p.kernel.arrays()[0].shape()[0])
            .collect();
        let joined = |arrays: Vec<&Array>| -> MlxResult<Array> {
            let all = mlx_rs::ops::concatenate(&arrays, 0)?;
            all.eval()?;
            Ok(all)
        };
        let kernels: Vec<Vec<&Array>> = parts.iter().map(|p| p.kernel.arrays()).collect();
        let stacked_arrays = (0..kernels[0].len())
            .map(|i| joined(kernels.iter().map(|k| k[i]).collect()))
            .collect::<MlxResult<Vec<Array>>>()?;
        let mut stacked_arrays = stacked_arrays.into_iter();
        let mut next = || {
            stacked_arrays
                .next()
                .expect("one stacked array per stored array")
        };
        let kernel = match &first.kernel {
            Kernel::Dense(_) => Kernel::Dense(next()),
            Kernel::Quantized {
                group_size, bits, ..
            } => Kernel::Quantized {
                weight: next(),
                scales: next(),
                biases: next(),
                group_size: *group_size,
                bits: *bits,
            },
        };
        let bias = match first.bias {
            Some(_) => Some(joined(
                parts
                    .iter()
                    .map(|p| p.bias.as_ref().expect("alike"))
                    .collect(),
            )?),
            None => None,
        };
        let stacked = Linear { kernel, bias };
        // Each part's arrays become views of its rows of the stack.
        let mut start = 0;
        for (part, rows) in parts.iter_mut().zip(rows) {
            let range = start..start + rows;
            let view = |all: &Array| -> MlxResult<Array> {
                use mlx_rs::ops::indexing::IndexOp;
                let view = all.index(range.clone());
                view.eval()?;
                Ok(view)
            };
            part.kernel = stacked.kernel.clone().map_rows(view)?;
            part.bias = stacked.bias.as_ref().map(view).transpose()?;
            start += rows;
        }
        Ok(Some(stacked))
    }
}

/// Token embeddings; also the output projection when embeddings are tied.
#[derive(Clone)]
pub struct Embedding {
    pub kernel: Kernel,
}

impl Embedding {
    /// Rows for `ids` (any shape) -> `[..ids, hidden]`.
    pub fn lookup(&self, ids: &Array) -> MlxResult<Array> {
        match &self.kernel {
            Kernel::Dense(table) => table.take_axis(ids, 0),
            Kernel::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => {
                let rows = weight.take_axis(ids, 0)?;
                let row_scales = scales.take_axis(ids, 0)?;
                let row_biases = biases.take_axis(ids, 0)?;
                dequantize_affine(&rows, &row_scales, &row_biases, *group_size, *bits)
            }
        }
    }

    /// `x @ E^T`: logits over the vocabulary.
    pub fn as_logits(&self, x: &Array) -> MlxResult<Array> {
        self.kernel.apply(x)
    }
}

/// llama.cpp tensor names -> Hugging Face names (suffix kept).
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    let (base, suffix) = name.rsplit_once('.')?;
    let mapped = match base {
        "token_embd" => "model.embed_tokens".to_owned(),
        "output_norm" => "model.norm".to_owned(),
        "output" => "lm_head".to_owned(),
        _ => {
            let rest = base.strip_prefix("blk.")?;
            let (layer, part) = rest.split_once('.')?;
            let hf = match part {
                "attn_norm" => "input_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                // Llama-style models have one norm before the MLP; Gemma's GGUF
                // names its pre-MLP norm the same and adds two post-norms.
                "ffn_norm" => "post_attention_layernorm",
                "post_attention_norm" => "gemma_post_attention_layernorm",
                "post_ffw_norm" => "post_feedforward_layernorm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                _ => return None,
            };
            format!("model.layers.{layer}.{hf}")
        }
    };
    Some(format!("{mapped}.{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::gguf_to_hf_name;

    #[test]
    fn gguf_names_map_to_hf_names_with_their_suffix() {
        assert_eq!(
            gguf_to_hf_name("blk.3.attn_q.scales").unwrap(),
            "model.layers.3.self_attn.q_proj.scales"
        );
        assert_eq!(
            gguf_to_hf_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(
            gguf_to_hf_name("blk.0.ffn_down.biases").unwrap(),
            "model.layers.0.mlp.down_proj.biases"
        );
        assert_eq!(gguf_to_hf_name("rope_freqs.weight"), None);
    }
}
