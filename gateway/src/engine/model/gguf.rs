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

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use mlx_rs::io::GgufFile;
use mlx_rs::ops::{concatenate, quantize};
use mlx_rs::{Array, Dtype};

use super::LoadError;
use super::weights::{WeightMap, gguf_to_hf_name};

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

/// A parsed GGUF file whose tensor data stays in a read-only memory map.
pub struct GgufReader {
    path: PathBuf,
    map: Mmap,
    pub version: u32,
    pub alignment: usize,
    metadata: HashMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
}

impl fmt::Debug for GgufReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufReader")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufReader {
    /// Maps and parses `path`: header, metadata and tensor table. Tensor data
    /// is only bounds-checked here; it is decoded on demand.
    pub fn open(path: &Path) -> Result<GgufReader, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 24 {
            return Err(GgufError::Truncated {
                what: "the header".into(),
                offset: 0,
                needed: 24,
                available: len as usize,
            });
        }
        // SAFETY: the map is read-only and private to this reader; a file
        // changed underneath while mapped is outside what we guard against
        // (model files are not rewritten in place).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let parsed = parse(&map)?;
        Ok(GgufReader {
            path: path.to_owned(),
            map,
            version: parsed.version,
            alignment: parsed.alignment,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &HashMap<String, MetaValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Can MLX's own loader read every tensor of this file?
    pub fn mlx_can_load(&self) -> bool {
        self.tensors.iter().all(|t| t.kind.mlx_native())
    }

    /// The raw bytes of a tensor (bounds checked when the file was opened).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        self.map
            .get(info.offset..info.offset + info.size)
            .unwrap_or(&[])
    }

    /// Every value of a tensor as f32, in row-major order.
    pub fn dequantize(&self, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let rows = info.elements() / info.row_len().max(1);
        self.dequantize_rows(info, 0..rows)
    }

    /// Rows `rows` (of `row_len` values each) of a tensor as f32.
    pub fn dequantize_rows(
        &self,
        info: &TensorInfo,
        rows: Range<usize>,
    ) -> Result<Vec<f32>, GgufError> {
        let bytes = self.row_bytes(info, rows.clone())?;
        let mut out = vec![0.0; rows.len() * info.row_len()];
        decode_blocks(info.kind, bytes, &mut out).ok_or_else(|| GgufError::UnsupportedType {
            name: info.name.clone(),
            kind: info.kind,
        })?;
        Ok(out)
    }

    /// The encoded bytes of rows `rows` of a tensor.
    pub fn row_bytes(&self, info: &TensorInfo, rows: Range<usize>) -> Result<&[u8], GgufError> {
        let (block_values, block_bytes) =
            info.kind
                .block()
                .ok_or_else(|| GgufError::UnsupportedType {
                    name: info.name.clone(),
                    kind: info.kind,
                })?;
        let row_bytes = info.row_len() / block_values * block_bytes;
        self.data(info)
            .get(rows.start * row_bytes..rows.end * row_bytes)
            .ok_or_else(|| GgufError::BadTensor {
                name: info.name.clone(),
                kind: info.kind,
                detail: format!("rows {rows:?} are outside the tensor"),
            })
    }
}

/// Decodes whole blocks of `kind` from `bytes` into `out` (one value per
/// slot). `None` if the type is not decodable or the lengths disagree.
pub fn decode_blocks(kind: GgmlType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    let (values, size) = kind.block()?;
    if !bytes.len().is_multiple_of(size) || bytes.len() / size * values != out.len() {
        return None;
    }
    let decode: fn(&[u8], &mut [f32]) = match kind {
        GgmlType::F32 => |b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, o| o[0] = f16_at(b, 0),
        GgmlType::BF16 => |b, o| o[0] = f32::from_bits(u32::from(u16_at(b, 0)) << 16),
        GgmlType::Q4_0 => decode_q4_0,
        GgmlType::Q4_1 => decode_q4_1,
        GgmlType::Q5_0 => decode_q5_0,
        GgmlType::Q5_1 => decode_q5_1,
        GgmlType::Q8_0 => decode_q8_0,
        GgmlType::Q4K => decode_q4_k,
        GgmlType::Q5K => decode_q5_k,
        GgmlType::Q6K => decode_q6_k,
        GgmlType::Other(_) => return None,
    };
    for (block, out) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(values)) {
        decode(block, out);
    }
    Some(())
}

/// Convenience for tests and tools: the values of whole blocks of `kind`.
pub fn dequantize_blocks(kind: GgmlType, bytes: &[u8]) -> Option<Vec<f32>> {
    let (values, size) = kind.block()?;
    let mut out = vec![0.0; bytes.len() / size * values];
    decode_blocks(kind, bytes, &mut out)?;
    Some(out)
}

// Block decoders, written from the GGML block definitions. Callers hand each
// one exactly one block (`chunks_exact`), so the fixed indices are in bounds.

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16_at(b, at)).to_f32()
}

/// Q4_0: f16 scale d, 16 bytes of nibbles; value = (q - 8) * d. Byte j holds
/// value j (low nibble) and value j + 16 (high nibble).
fn decode_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        out[j] = (i32::from(q & 0xf) - 8) as f32 * d;
        out[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// Q4_1: f16 scale d and min m, nibbles as Q4_0; value = q * d + m.
fn decode_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        out[j] = f32::from(q & 0xf) * d + m;
        out[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// The fifth bit of value `j` of a Q5 block, from its 32-bit high-bit mask.
fn high_bit(mask: u32, j: usize) -> u8 {
    (((mask >> j) & 1) as u8) << 4
}

/// Q5_0: f16 d, u32 of fifth bits, nibbles as Q4_0; value = (q - 16) * d.
fn decode_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let mask = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let lo = (q & 0xf) | high_bit(mask, j);
        let hi = (q >> 4) | high_bit(mask, j + 16);
        out[j] = (i32::from(lo) - 16) as f32 * d;
        out[j + 16] = (i32::from(hi) - 16) as f32 * d;
    }
}

/// Q5_1: f16 d and m, u32 of fifth bits, nibbles; value = q * d + m.
fn decode_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let mask = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, &q) in b[8..24].iter().enumerate() {
        out[j] = f32::from((q & 0xf) | high_bit(mask, j)) * d + m;
        out[j + 16] = f32::from((q >> 4) | high_bit(mask, j + 16)) * d + m;
    }
}

/// Q8_0: f16 d, 32 signed bytes; value = q * d.
fn decode_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block,
/// packed into 12 bytes: sub-blocks 0-3 use the low 6 bits of bytes j and
/// j + 4; sub-blocks 4-7 take their low 4 bits from byte j + 4's nibbles and
/// their top 2 bits from the spare top bits of bytes j - 4 and j.
fn scale_min(packed: &[u8], j: usize) -> (f32, f32) {
    let (scale, min) = if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0xf) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    };
    (f32::from(scale), f32::from(min))
}

/// Q4_K: 256 values in 8 sub-blocks of 32, f16 d and dmin, 12 bytes of
/// 6-bit scales/mins, 128 bytes of nibbles. Each 32 bytes of nibbles hold
/// two sub-blocks: low nibbles the first, high nibbles the second.
/// value = d * scale * q - dmin * min.
fn decode_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let packed = &b[4..16];
    for (pair, (qs, out)) in b[16..144]
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (s1, m1) = scale_min(packed, 2 * pair);
        let (s2, m2) = scale_min(packed, 2 * pair + 1);
        let (d1, m1, d2, m2) = (d * s1, dmin * m1, d * s2, dmin * m2);
        for (l, &q) in qs.iter().enumerate() {
            out[l] = d1 * f32::from(q & 0xf) - m1;
            out[l + 32] = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// Q5_K: as Q4_K plus 32 bytes of fifth bits: bit 2p of byte l is the fifth
/// bit of value l of sub-block 2p, bit 2p + 1 that of sub-block 2p + 1.
fn decode_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let packed = &b[4..16];
    let high = &b[16..48];
    for (pair, (qs, out)) in b[48..176]
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (s1, m1) = scale_min(packed, 2 * pair);
        let (s2, m2) = scale_min(packed, 2 * pair + 1);
        let (d1, m1, d2, m2) = (d * s1, dmin * m1, d * s2, dmin * m2);
        for (l, (&q, &h)) in qs.iter().zip(high).enumerate() {
            let lo = (q & 0xf) | (((h >> (2 * pair)) & 1) << 4);
            let hi = (q >> 4) | (((h >> (2 * pair + 1)) & 1) << 4);
            out[l] = d1 * f32::from(lo) - m1;
            out[l + 32] = d2 * f32::from(hi) - m2;
        }
    }
}

/// Q6_K: 256 values in 16 sub-blocks of 16; 128 bytes of low nibbles, 64
/// bytes of 2-bit high parts, 16 signed 8-bit scales, f16 d.
/// value = d * scale * (q - 32). Each half (128 values) uses 64 low-nibble
/// bytes and 32 high bytes: value l + 32k (k = 0..4) takes its low nibble from
/// byte l (k even) or l + 32 (k odd), low half for k < 2, and bits 2k..2k+2 of
/// high byte l.
fn decode_q6_k(b: &[u8], out: &mut [f32]) {
    let mut codes = [0u8; 256];
    q6_k_codes(b, &mut codes);
    for (g, (out, codes)) in out
        .chunks_exact_mut(16)
        .zip(codes.chunks_exact(16))
        .enumerate()
    {
        let scale = q6_k_scale(b, g);
        for (value, &code) in out.iter_mut().zip(codes) {
            *value = scale * (i32::from(code) - 32) as f32;
        }
    }
}

/// A Q6_K block's 256 six-bit codes (`q`, the value being `scale * (q - 32)`).
fn q6_k_codes(b: &[u8], codes: &mut [u8]) {
    for half in 0..2 {
        let low = &b[64 * half..64 * half + 64];
        let high = &b[128 + 32 * half..128 + 32 * half + 32];
        let codes = &mut codes[128 * half..128 * half + 128];
        for l in 0..32 {
            let h = high[l];
            codes[l] = (low[l] & 0xf) | ((h & 3) << 4);
            codes[l + 32] = (low[l + 32] & 0xf) | (((h >> 2) & 3) << 4);
            codes[l + 64] = (low[l] >> 4) | (((h >> 4) & 3) << 4);
            codes[l + 96] = (low[l + 32] >> 4) | (((h >> 6) & 3) << 4);
        }
    }
}

/// The scale of sub-block `g` (16 values) of a Q6_K block: `d * scale_g`,
/// an exact f32 product (11 by 8 significant bits).
fn q6_k_scale(b: &[u8], g: usize) -> f32 {
    f16_at(b, 208) * f32::from(b[192 + g] as i8)
}

struct Parsed {
    version: u32,
    alignment: usize,
    metadata: HashMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let available = self.bytes.len() - self.at;
        if n > available as u64 {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.at,
                needed: n,
                available,
            });
        }
        let slice = &self.bytes[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { what: what() })
    }

    /// A count of items each at least `min_size` bytes long: bounded by the
    /// bytes left, so a corrupt count cannot make us allocate without limit.
    fn count(&mut self, min_size: usize, what: &dyn Fn() -> String) -> Result<usize, GgufError> {
        let count = self.u64(what)?;
        let available = self.bytes.len() - self.at;
        if count > (available / min_size.max(1)) as u64 {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.at,
                needed: count.saturating_mul(min_size as u64),
                available,
            });
        }
        Ok(count as usize)
    }

    fn value(&mut self, kind: u32, key: &str) -> Result<MetaValue, GgufError> {
        let what = || format!("metadata `{key}`");
        Ok(match kind {
            0 => MetaValue::U8(self.array::<1>(&what)?[0]),
            1 => MetaValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => MetaValue::U32(self.u32(&what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => MetaValue::Bool(self.array::<1>(&what)?[0] != 0),
            8 => MetaValue::String(self.string(&what)?),
            9 => {
                let item_kind = self.u32(&what)?;
                if item_kind > 12 {
                    return Err(GgufError::BadValueType {
                        key: key.to_owned(),
                        kind: item_kind,
                    });
                }
                let count = self.count(1, &what)?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.value(item_kind, key)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(&what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(&what)?)),
            other => {
                return Err(GgufError::BadValueType {
                    key: key.to_owned(),
                    kind: other,
                });
            }
        })
    }
}

fn parse(bytes: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { bytes, at: 0 };
    let header = || "the header".to_owned();
    let magic = c.array::<4>(&header)?;
    if &magic != MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32(&header)?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    // A tensor entry takes at least 8 + 4 + 4 + 8 bytes, a metadata entry 8 + 4 + 1.
    let tensor_count = c.count(24, &|| "the tensor count".into())?;
    let kv_count = c.count(13, &|| "the metadata count".into())?;
    let mut metadata = HashMap::with_capacity(kv_count);
    for index in 0..kv_count {
        let key = c.string(&|| format!("the key of metadata entry {index}"))?;
        let kind = c.u32(&|| format!("the type of metadata `{key}`"))?;
        let value = c.value(kind, &key)?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        Some(value) => {
            let a = value.as_f64().unwrap_or(0.0) as u64;
            if a == 0 || !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(a));
            }
            a as usize
        }
        None => DEFAULT_ALIGNMENT,
    };
    let mut infos = Vec::with_capacity(tensor_count);
    for index in 0..tensor_count {
        let name = c.string(&|| format!("the name of tensor {index}"))?;
        let what = || format!("the entry of tensor `{name}`");
        let n_dims = c.u32(&what)?;
        if n_dims > 4 {
            return Err(GgufError::BadTensor {
                name,
                kind: GgmlType::Other(u32::MAX),
                detail: format!("{n_dims} dimensions (GGUF allows at most 4)"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let kind = GgmlType::from_id(c.u32(&what)?);
        let offset = c.u64(&what)?;
        infos.push((name, dims, kind, offset));
    }
    let data_start = c.at.div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, dims, kind, offset) in infos {
        let bad = |detail: String| GgufError::BadTensor {
            name: name.clone(),
            kind,
            detail,
        };
        let elements = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .filter(|&n| n <= bytes.len() as u64 * 8)
            .ok_or_else(|| bad(format!("dimensions {dims:?} are too large")))?;
        let size = match kind.block() {
            Some((values, block_bytes)) => {
                let row = dims.first().copied().unwrap_or(1);
                if row % values as u64 != 0 {
                    return Err(bad(format!(
                        "rows of {row} values are not whole blocks of {values}"
                    )));
                }
                elements / values as u64 * block_bytes as u64
            }
            // Unknown types: no size to check; decoding them fails later by name.
            None => 0,
        };
        let start = (data_start as u64)
            .checked_add(offset)
            .filter(|_| offset % alignment as u64 == 0)
            .ok_or_else(|| bad(format!("offset {offset} is not aligned to {alignment}")))?;
        let end = start.saturating_add(size);
        if end > bytes.len() as u64 {
            return Err(GgufError::Truncated {
                what: format!("the data of tensor `{name}` ({kind})"),
                offset: start.min(bytes.len() as u64) as usize,
                needed: size,
                available: bytes.len().saturating_sub(start as usize),
            });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            kind,
            offset: start as usize,
            size: size as usize,
        });
    }
    Ok(Parsed {
        version,
        alignment,
        metadata,
        tensors,
    })
}

/// A tensor to write with [`write_gguf`]: its encoded blocks, as stored.
pub struct TensorData {
    pub name: String,
    /// GGUF order: innermost dimension first.
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    pub bytes: Vec<u8>,
}

/// Writes a GGUF v3 file (for test fixtures and tools): `metadata` in the
/// given order, tensors aligned to 32 bytes.
pub fn write_gguf(
    path: &Path,
    metadata: &[(&str, MetaValue)],
    tensors: &[TensorData],
) -> std::io::Result<()> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    fn value(out: &mut Vec<u8>, v: &MetaValue) {
        match v {
            MetaValue::U8(x) => out.push(*x),
            MetaValue::I8(x) => out.push(*x as u8),
            MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::Bool(x) => out.push(u8::from(*x)),
            MetaValue::String(s) => string(out, s),
            MetaValue::Array(items) => {
                let kind = items.first().map_or(0, MetaValue::type_id);
                out.extend_from_slice(&kind.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    value(out, item);
                }
            }
        }
    }
    let align = |n: usize| n.div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, v) in metadata {
        string(&mut out, key);
        out.extend_from_slice(&v.type_id().to_le_bytes());
        value(&mut out, v);
    }
    let mut offset = 0;
    for tensor in tensors {
        string(&mut out, &tensor.name);
        out.extend_from_slice(&(tensor.dims.len() as u32).to_le_bytes());
        for d in &tensor.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&tensor.kind.id().to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = align(offset + tensor.bytes.len());
    }
    out.resize(align(out.len()), 0);
    for tensor in tensors {
        out.extend_from_slice(&tensor.bytes);
        out.resize(align(out.len()), 0);
    }
    File::create(path)?.write_all(&out)
}

/// Metadata lookups the model config and the tokenizer need, answered by MLX's
/// loader ([`GgufFile`]) or by ours ([`GgufReader`]).
pub trait GgufMetadata {
    fn meta_string(&self, key: &str) -> Result<Option<String>, LoadError>;
    fn meta_strings(&self, key: &str) -> Result<Option<Vec<String>>, LoadError>;
    /// A number or boolean (booleans as 0 / 1).
    fn meta_number(&self, key: &str) -> Result<Option<f64>, LoadError>;
    /// An array of numbers (token types, scores).
    fn meta_numbers(&self, key: &str) -> Result<Option<Vec<f64>>, LoadError>;
}

impl GgufMetadata for GgufReader {
    fn meta_string(&self, key: &str) -> Result<Option<String>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.wrong_type(key, "a string", other)),
        }
    }

    fn meta_strings(&self, key: &str) -> Result<Option<Vec<String>>, LoadError> {
        let items = self.array(key, "an array of strings")?;
        items
            .map(|items| {
                items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| self.wrong_type(key, "an array of strings", v))
                    })
                    .collect()
            })
            .transpose()
    }

    fn meta_number(&self, key: &str) -> Result<Option<f64>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a number", value)),
        }
    }

    fn meta_numbers(&self, key: &str) -> Result<Option<Vec<f64>>, LoadError> {
        let items = self.array(key, "an array of numbers")?;
        items
            .map(|items| {
                items
                    .iter()
                    .map(|v| {
                        v.as_f64()
                            .ok_or_else(|| self.wrong_type(key, "an array of numbers", v))
                    })
                    .collect()
            })
            .transpose()
    }
}

impl GgufReader {
    fn array(&self, key: &str, wanted: &str) -> Result<Option<&[MetaValue]>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(items)) => Ok(Some(items)),
            Some(other) => Err(self.wrong_type(key, wanted, other)),
        }
    }

    fn wrong_type(&self, key: &str, wanted: &str, found: &MetaValue) -> LoadError {
        let found = match found {
            MetaValue::String(_) => "a string".to_owned(),
            MetaValue::Array(_) => "an array".to_owned(),
            other => format!("{other:?}"),
        };
        LoadError::Io(
            self.path.clone(),
            format!("metadata `{key}` should be {wanted}, found {found}"),
        )
    }
}

impl GgufMetadata for GgufFile {
    fn meta_string(&self, key: &str) -> Result<Option<String>, LoadError> {
        self.get_metadata_string(key).map_err(mlx_meta)
    }

    fn meta_strings(&self, key: &str) -> Result<Option<Vec<String>>, LoadError> {
        self.get_metadata_strings(key).map_err(mlx_meta)
    }

    fn meta_number(&self, key: &str) -> Result<Option<f64>, LoadError> {
        let Some(array) = self.get_metadata_array(key).map_err(mlx_meta)? else {
            return Ok(None);
        };
        let array = array
            .as_dtype(Dtype::Float64)
            .map_err(|e| LoadError::Mlx(e.to_string()))?;
        Ok(array.as_slice::<f64>().first().copied())
    }

    fn meta_numbers(&self, key: &str) -> Result<Option<Vec<f64>>, LoadError> {
        let Some(array) = self.get_metadata_array(key).map_err(mlx_meta)? else {
            return Ok(None);
        };
        let array = array
            .as_dtype(Dtype::Float64)
            .map_err(|e| LoadError::Mlx(e.to_string()))?;
        Ok(Some(array.as_slice::<f64>().to_vec()))
    }
}

fn mlx_meta(e: mlx_rs::io::GgufError) -> LoadError {
    LoadError::Mlx(e.to_string())
}

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

/// One block -> its codes, and a scale and bias per group of codes.
type AffineSplit = fn(&[u8], &mut [u8], &mut [f32], &mut [f32]);

/// Values per scale of a quantized type whose blocks are affine codes.
fn affine_group_size(kind: GgmlType) -> Option<usize> {
    match kind {
        GgmlType::Q6K => Some(16),
        GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q8_0
        | GgmlType::Q4K
        | GgmlType::Q5K => Some(32),
        _ => None,
    }
}

/// Splits blocks into integer codes and a scale and bias per group (32
/// values; 16 for Q6_K) with `value = scale * code + bias`. `None` for
/// floats or mismatched lengths.
pub fn affine_blocks(
    kind: GgmlType,
    bytes: &[u8],
    codes: &mut [u8],
    scales: &mut [f32],
    biases: &mut [f32],
) -> Option<()> {
    let (values, size) = kind.block()?;
    let blocks = bytes.len() / size;
    let groups = values / affine_group_size(kind)?;
    if !bytes.len().is_multiple_of(size)
        || codes.len() != blocks * values
        || scales.len() != blocks * groups
        || biases.len() != blocks * groups
    {
        return None;
    }
    let split: AffineSplit = match kind {
        GgmlType::Q4_0 => |b, c, s, m| {
            nibbles(&b[2..18], c);
            s[0] = f16_at(b, 0);
            m[0] = -8.0 * s[0];
        },
        GgmlType::Q4_1 => |b, c, s, m| {
            nibbles(&b[4..20], c);
            (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
        },
        GgmlType::Q5_0 => |b, c, s, m| {
            nibbles(&b[6..22], c);
            fifth_bits(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), c);
            s[0] = f16_at(b, 0);
            m[0] = -16.0 * s[0];
        },
        GgmlType::Q5_1 => |b, c, s, m| {
            nibbles(&b[8..24], c);
            fifth_bits(u32::from_le_bytes([b[4], b[5], b[6], b[7]]), c);
            (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
        },
        GgmlType::Q8_0 => |b, c, s, m| {
            for (code, &q) in c.iter_mut().zip(&b[2..34]) {
                *code = (q as i8 as i16 + 128) as u8;
            }
            s[0] = f16_at(b, 0);
            m[0] = -128.0 * s[0];
        },
        GgmlType::Q4K => |b, c, s, m| k_quant_affine(b, &b[16..144], None, c, s, m),
        GgmlType::Q5K => |b, c, s, m| k_quant_affine(b, &b[48..176], Some(&b[16..48]), c, s, m),
        GgmlType::Q6K => |b, c, s, m| {
            q6_k_codes(b, c);
            for (g, (s, m)) in s.iter_mut().zip(m).enumerate() {
                *s = q6_k_scale(b, g);
                *m = -32.0 * *s;
            }
        },
        _ => return None,
    };
    for (((block, c), s), m) in bytes
        .chunks_exact(size)
        .zip(codes.chunks_exact_mut(values))
        .zip(scales.chunks_exact_mut(groups))
        .zip(biases.chunks_exact_mut(groups))
    {
        split(block, c, s, m);
    }
    Some(())
}

/// 16 bytes of nibbles -> 32 codes: low nibbles are values 0-15, high 16-31.
fn nibbles(qs: &[u8], codes: &mut [u8]) {
    for (j, &q) in qs.iter().enumerate() {
        codes[j] = q & 0xf;
        codes[j + 16] = q >> 4;
    }
}

fn fifth_bits(mask: u32, codes: &mut [u8]) {
    for (j, code) in codes.iter_mut().enumerate() {
        *code |= high_bit(mask, j);
    }
}

/// Q4_K / Q5_K: 8 groups of 32 with scale `d * sc` and bias `-dmin * m`.
fn k_quant_affine(
    b: &[u8],
    qs: &[u8],
    high: Option<&[u8]>,
    codes: &mut [u8],
    scales: &mut [f32],
    biases: &mut [f32],
) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let packed = &b[4..16];
    for (pair, (qs, codes)) in qs
        .chunks_exact(32)
        .zip(codes.chunks_exact_mut(64))
        .enumerate()
    {
        for half in 0..2 {
            let (sc, min) = scale_min(packed, 2 * pair + half);
            scales[2 * pair + half] = d * sc;
            biases[2 * pair + half] = -(dmin * min);
        }
        for (l, &q) in qs.iter().enumerate() {
            codes[l] = q & 0xf;
            codes[l + 32] = q >> 4;
            if let Some(high) = high {
                codes[l] |= ((high[l] >> (2 * pair)) & 1) << 4;
                codes[l + 32] |= ((high[l] >> (2 * pair + 1)) & 1) << 4;
            }
        }
    }
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
    read_weights(reader, float_dtype, Some(target))
}

/// Every tensor dense (no requantization): the exact decoded values, for
/// measuring what requantization changes. Needs 4 bytes per parameter.
pub fn dense_weight_map(reader: &GgufReader, float_dtype: Dtype) -> Result<WeightMap, LoadError> {
    read_weights(reader, float_dtype, None)
}

/// `quantized`: the target of 2-D quantized tensors, or `None` to decode
/// every tensor to floats.
fn read_weights(
    reader: &GgufReader,
    float_dtype: Dtype,
    quantized: Option<LayoutTarget>,
) -> Result<WeightMap, LoadError> {
    let mut tensors = HashMap::with_capacity(reader.tensors().len() * 3);
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
                tensors.insert(format!("{prefix}.scales"), scales);
                tensors.insert(format!("{prefix}.biases"), biases);
                tensors.insert(name, weight);
            }
            None => {
                let values = reader
                    .dequantize(info)
                    .map_err(|e| LoadError::Io(reader.path().to_owned(), e.to_string()))?;
                let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
                let array = Array::from_slice(&values, &dims)
                    .as_dtype(float_dtype)
                    .map_err(|e| tensor_error(reader, info, e))?;
                tensors.insert(name, array);
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
