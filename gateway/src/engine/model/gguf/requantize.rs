//! Tensors into MLX's affine layout (`weight` u32 codes, `scales`,
//! `biases`): which layout each GGML type takes, carrying codes over exactly
//! where the format allows or requantizing with MLX where not, and the whole
//! file read into a [`WeightMap`].

use std::collections::HashMap;
use std::fmt;

use mlx_rs::ops::{concatenate, quantize};
use mlx_rs::{Array, Dtype};

use super::blocks::affine_blocks;
use super::{GgmlType, GgufError, GgufReader, TensorInfo};
use crate::engine::model::LoadError;
use crate::engine::model::weights::{WeightMap, gguf_to_hf_name};

/// Whose kernels will multiply converted weights: it decides how Q6_K is
/// stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutTarget {
    /// mlxgate's CPU kernels, which also take groups of 16.
    NativeKernels,
    /// MLX's own kernels and mlx-lm: groups of 32, 64 or 128.
    Mlx,
}

impl LayoutTarget {
    /// The kernels this process multiplies with: native where they run.
    pub fn for_this_process() -> LayoutTarget {
        if crate::mlx::kernels::native_available() {
            LayoutTarget::NativeKernels
        } else {
            LayoutTarget::Mlx
        }
    }
}

/// How a quantized GGUF type is stored in MLX's affine layout: `bits` with
/// one scale and bias per `group_size` values, and whether that is exact.
///
/// Every GGML type whose scales cover 32 values (Q4_0, Q4_1, Q5_0, Q5_1,
/// Q8_0, and the 32-value sub-blocks of Q4_K / Q5_K) is an affine code
/// `scale * q + bias` per 32 values already, so it is carried over exactly:
/// 4-bit codes into 4 bits, 5- and 8-bit codes into 8 bits (the kernels
/// handle 4 and 8 bits; 5 bits would pack tighter). Requantizing the decoded
/// values with MLX's `quantize` instead was measured on the Gemma 3 and Qwen2.5
/// files (relative Frobenius error): ~8% at 4 bits / group 32 even for Q4_K
/// data (MLX shifts its grid to hold zero exactly), ~0.5% at 8 bits. Q6_K has
/// a scale per 16 values: mlxgate's kernels take groups of 16, so for them it
/// is carried over exactly too (8-bit codes); MLX's groups of 32 (its
/// smallest) cannot hold it, so for MLX it is requantized to 8 bits / group
/// 32 (0.5%; 4 bits: 8.5%).
pub fn mlx_quantization(kind: GgmlType, target: LayoutTarget) -> Option<MlxLayout> {
    let (group_size, bits, exact) = match kind {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => (32, 4, true),
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K | GgmlType::Q8_0 => (32, 8, true),
        GgmlType::Q6K if target == LayoutTarget::NativeKernels => (16, 8, true),
        GgmlType::Q6K => (32, 8, false),
        _ => return None,
    };
    Some(MlxLayout {
        group_size,
        bits,
        exact,
    })
}

/// MLX affine layout chosen for a GGML type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlxLayout {
    pub group_size: i32,
    pub bits: i32,
    /// Codes, scales and biases are carried over (no requantization error).
    pub exact: bool,
}

/// Packs codes into MLX's u32 words: `32 / bits` codes per word, the first
/// in the lowest bits.
fn pack_codes(codes: &[u8], bits: u32) -> Vec<u32> {
    let per_word = (32 / bits) as usize;
    codes
        .chunks(per_word)
        .map(|chunk| {
            chunk.iter().enumerate().fold(0u32, |word, (k, &c)| {
                word | (u32::from(c) << (k as u32 * bits))
            })
        })
        .collect()
}

/// Values decoded and handed to MLX per step while converting, so a large
/// embedding table never exists whole in f32 or as unpacked codes.
const CHUNK_VALUES: usize = 1 << 22;

/// Reads every tensor of `reader` into a [`WeightMap`] with Hugging Face
/// names, as [`WeightMap::from_gguf`] does through MLX: quantized 2-D weights
/// become MLX affine (`weight` u32, `scales`, `biases`), the rest dense
/// `float_dtype`.
/// `target` decides how Q6_K is stored (see [`mlx_quantization`]).
pub fn weight_map(
    reader: &GgufReader,
    float_dtype: Dtype,
    target: LayoutTarget,
) -> Result<WeightMap, LoadError> {
    read_weights(reader, float_dtype, Some(target), &mut keep_whole)
}

/// What [`weight_map_sliced`] keeps of a tensor (by its HF name): a slice
/// of it, all of it, or nothing (`None`).
pub type TensorSlicer<'a> = dyn FnMut(&str, Array) -> mlx_rs::error::Result<Option<Array>> + 'a;

fn keep_whole(_: &str, array: Array) -> mlx_rs::error::Result<Option<Array>> {
    Ok(Some(array))
}

/// [`weight_map`] where each tensor passes through `slice` as soon as it
/// is read, so that only what it keeps stays in memory: a rank of a split
/// model reads its slice of the file, never the whole model.
pub fn weight_map_sliced(
    reader: &GgufReader,
    float_dtype: Dtype,
    target: LayoutTarget,
    slice: &mut TensorSlicer,
) -> Result<WeightMap, LoadError> {
    read_weights(reader, float_dtype, Some(target), slice)
}

/// Every tensor dense (no requantization): the exact decoded values, for
/// measuring what requantization changes. Needs 4 bytes per parameter.
pub fn dense_weight_map(reader: &GgufReader, float_dtype: Dtype) -> Result<WeightMap, LoadError> {
    read_weights(reader, float_dtype, None, &mut keep_whole)
}

/// `quantized`: the target of 2-D quantized tensors, or `None` to decode
/// every tensor to floats.
fn read_weights(
    reader: &GgufReader,
    float_dtype: Dtype,
    quantized: Option<LayoutTarget>,
    slice: &mut TensorSlicer,
) -> Result<WeightMap, LoadError> {
    let mut tensors = HashMap::with_capacity(reader.tensors().len() * 3);
    let mut keep = |info: &TensorInfo, name: String, array: Array| -> Result<(), LoadError> {
        if let Some(kept) = slice(&name, array).map_err(|e| tensor_error(reader, info, e))? {
            tensors.insert(name, kept);
        }
        Ok(())
    };
    for info in reader.tensors() {
        let name = gguf_to_hf_name(&info.name).unwrap_or_else(|| info.name.clone());
        let shape = info.shape();
        let plan = quantized
            .and_then(|target| mlx_quantization(info.kind, target))
            .filter(|layout| {
                shape.len() == 2
                    && shape.iter().all(|&d| d > 0)
                    && shape[1] % layout.group_size as usize == 0
            });
        match plan {
            Some(layout) => {
                let (weight, scales, biases) = to_mlx_affine(reader, info, layout)
                    .map_err(|e| tensor_error(reader, info, e))?;
                let prefix = name.strip_suffix(".weight").unwrap_or(&name).to_owned();
                keep(info, format!("{prefix}.scales"), scales)?;
                keep(info, format!("{prefix}.biases"), biases)?;
                keep(info, name, weight)?;
            }
            None => {
                let values = reader
                    .dequantize(info)
                    .map_err(|e| LoadError::Io(reader.path().to_owned(), e.to_string()))?;
                let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
                let array = Array::from_slice(&values, &dims)
                    .as_dtype(float_dtype)
                    .map_err(|e| tensor_error(reader, info, e))?;
                keep(info, name, array)?;
            }
        }
    }
    Ok(WeightMap::new(tensors, float_dtype))
}

fn tensor_error(reader: &GgufReader, info: &TensorInfo, e: impl fmt::Display) -> LoadError {
    LoadError::Io(
        reader.path().to_owned(),
        format!("tensor `{}` ({}): {e}", info.name, info.kind),
    )
}

/// A 2-D tensor in MLX's affine layout `(weight, scales, biases)`: carried
/// over exactly where `layout.exact`, else decoded and quantized by MLX, in
/// row chunks either way.
pub fn to_mlx_affine(
    reader: &GgufReader,
    info: &TensorInfo,
    layout: MlxLayout,
) -> Result<(Array, Array, Array), RequantizeError> {
    let shape = info.shape();
    let (rows, cols) = (shape[0], shape[1]);
    let MlxLayout {
        group_size, bits, ..
    } = layout;
    let step = (CHUNK_VALUES / cols).max(1);
    let (mut weights, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
    for start in (0..rows).step_by(step) {
        let end = (start + step).min(rows);
        let n = (end - start) as i32;
        let (w, s, b) = if layout.exact {
            let bytes = reader.row_bytes(info, start..end)?;
            let values = (end - start) * cols;
            let groups = values / group_size as usize;
            let mut codes = vec![0u8; values];
            let (mut s, mut b) = (vec![0f32; groups], vec![0f32; groups]);
            affine_blocks(info.kind, bytes, &mut codes, &mut s, &mut b).ok_or_else(|| {
                GgufError::UnsupportedType {
                    name: info.name.clone(),
                    kind: info.kind,
                }
            })?;
            let words = pack_codes(&codes, bits as u32);
            let groups_per_row = (cols / group_size as usize) as i32;
            (
                Array::from_slice(&words, &[n, cols as i32 * bits / 32]),
                Array::from_slice(&s, &[n, groups_per_row]),
                Array::from_slice(&b, &[n, groups_per_row]),
            )
        } else {
            let values = reader.dequantize_rows(info, start..end)?;
            let dense = Array::from_slice(&values, &[n, cols as i32]);
            let (w, s, b) = quantize(&dense, group_size, bits)?;
            mlx_rs::transforms::eval([&w, &s, &b])?;
            (w, s, b)
        };
        weights.push(w);
        scales.push(s);
        biases.push(b);
    }
    let join = |parts: Vec<Array>| -> Result<Array, RequantizeError> {
        if parts.len() == 1 {
            return Ok(parts
                .into_iter()
                .next()
                .unwrap_or_else(|| Array::from_f32(0.0)));
        }
        let joined = concatenate(&parts, 0)?;
        joined.eval()?;
        Ok(joined)
    };
    Ok((join(weights)?, join(scales)?, join(biases)?))
}

/// Decoding or MLX failed while requantizing a tensor.
#[derive(Debug, thiserror::Error)]
pub enum RequantizeError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}
