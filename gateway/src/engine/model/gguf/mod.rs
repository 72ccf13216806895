//! Our own GGUF reader: header, metadata, tensor table and block
//! dequantization, over a memory map of the file.
//!
//! MLX's loader reads Q4_0/Q4_1/Q8_0/F16/F32 natively but rejects a whole file
//! as soon as one tensor has another type (K-quants, Q5_x, BF16). For such
//! files this reader decodes every tensor to f32 and requantizes the 2-D ones
//! to MLX's affine layout ([`weight_map`]), producing the same [`WeightMap`]
//! names and layout the MLX path does.
//!
//! Every length and offset in the file is checked: a truncated or corrupt file
//! is an error naming what was being read, never a panic.
//!
//! This module holds the vocabulary every part shares (errors, tensor types,
//! metadata values, tensor-table entries); the parts sit in submodules whose
//! items are re-exported here, so `gguf::X` names everything:
//!
//! * `reader`: opening and parsing a file ([`GgufReader`]);
//! * `metadata`: typed metadata lookups over either loader ([`GgufMetadata`]);
//! * `blocks`: the GGML block formats, decoded to f32 or split into affine codes;
//! * `writer`: writing a GGUF file ([`write_gguf`], for fixtures and tools);
//! * `requantize`: tensors into MLX's affine layout ([`weight_map`]).
//!
//! [`WeightMap`]: super::weights::WeightMap

use std::fmt;
use std::path::PathBuf;

mod blocks;
mod metadata;
mod reader;
mod requantize;
mod writer;

pub use blocks::{affine_blocks, decode_blocks};
pub use metadata::GgufMetadata;
pub use reader::GgufReader;
pub use requantize::{
    LayoutTarget, MlxLayout, RequantizeError, TensorSlicer, dense_weight_map, mlx_quantization,
    to_mlx_affine, weight_map, weight_map_sliced,
};
pub use writer::{TensorData, write_gguf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;

/// Why a GGUF file could not be read. Each message names the file part,
/// metadata key or tensor (and its type) concerned.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file (starts with {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (versions 2 and 3 are)")]
    UnsupportedVersion(u32),
    /// The file ends (or a length field points) before the data it announces.
    #[error(
        "truncated or corrupt GGUF: {what} at byte {offset} needs {needed} bytes, {available} left"
    )]
    Truncated {
        what: String,
        offset: usize,
        needed: u64,
        available: usize,
    },
    #[error("metadata `{key}`: unknown value type {kind}")]
    BadValueType { key: String, kind: u32 },
    #[error("{what} is not valid UTF-8")]
    BadUtf8 { what: String },
    #[error("metadata `general.alignment` = {0} is not a power of two")]
    BadAlignment(u64),
    /// Shape, offset or size of a tensor is inconsistent with its type or the file.
    #[error("tensor `{name}` ({kind}): {detail}")]
    BadTensor {
        name: String,
        kind: GgmlType,
        detail: String,
    },
    #[error(
        "tensor `{name}`: GGML type {kind} cannot be decoded (supported: {})",
        GgmlType::SUPPORTED
    )]
    UnsupportedType { name: String, kind: GgmlType },
}

/// GGML tensor types this reader knows by name. Others keep their id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    Other(u32),
}

impl GgmlType {
    const SUPPORTED: &'static str =
        "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K";

    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
            GgmlType::Other(id) => id,
        }
    }

    /// `(values per block, bytes per block)`; `None` for types we cannot decode.
    pub fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Other(_) => return None,
        })
    }

    /// Types MLX's own GGUF loader reads; one tensor of any other type makes
    /// it reject the whole file.
    pub fn mlx_native(self) -> bool {
        matches!(
            self,
            GgmlType::F32 | GgmlType::F16 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0
        )
    }

    pub fn is_float(self) -> bool {
        matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::BF16 => "BF16",
            GgmlType::Other(id) => return write!(f, "type #{id}"),
        };
        f.write_str(name)
    }
}

/// A metadata value, as typed in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Numbers and booleans as f64 (every GGUF integer that matters fits).
    pub fn as_f64(&self) -> Option<f64> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v as f64,
            MetaValue::I64(v) => v as f64,
            MetaValue::F32(v) => v.into(),
            MetaValue::F64(v) => v,
            MetaValue::Bool(v) => f64::from(u8::from(v)),
            MetaValue::String(_) | MetaValue::Array(_) => return None,
        })
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::String(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: the innermost (contiguous) dimension first.
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Bytes of data.
    pub size: usize,
}

impl TensorInfo {
    /// Row-major shape (outermost first), as MLX and Hugging Face write it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// Values per row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.dims.first().map_or(1, |&d| d as usize)
    }
}
