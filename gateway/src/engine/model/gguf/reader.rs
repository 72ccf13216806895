//! Opening a GGUF file: the memory map, the bounds-checked parse of its
//! header, metadata and tensor table, and on-demand access to tensor data
//! (raw rows or decoded to f32).

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::blocks::decode_blocks;
use super::{DEFAULT_ALIGNMENT, GgmlType, GgufError, MAGIC, MetaValue, TensorInfo};

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
    let (version, tensor_count, kv_count) = c.header()?;
    let metadata = c.metadata(kv_count)?;
    let alignment = alignment(&metadata)?;
    let mut entries = Vec::with_capacity(tensor_count);
    for index in 0..tensor_count {
        entries.push(c.tensor_entry(index)?);
    }
    let data_start = c.at.div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(entries.len());
    for entry in entries {
        tensors.push(entry.locate(bytes.len(), data_start, alignment)?);
    }
    Ok(Parsed {
        version,
        alignment,
        metadata,
        tensors,
    })
}

impl Cursor<'_> {
    /// The magic number and version, and the tensor and metadata counts.
    fn header(&mut self) -> Result<(u32, usize, usize), GgufError> {
        let header = || "the header".to_owned();
        let magic = self.array::<4>(&header)?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = self.u32(&header)?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // A tensor entry takes at least 8 + 4 + 4 + 8 bytes, a metadata entry 8 + 4 + 1.
        let tensor_count = self.count(24, &|| "the tensor count".into())?;
        let kv_count = self.count(13, &|| "the metadata count".into())?;
        Ok((version, tensor_count, kv_count))
    }

    /// `count` metadata entries: key, value type, value.
    fn metadata(&mut self, count: usize) -> Result<HashMap<String, MetaValue>, GgufError> {
        let mut metadata = HashMap::with_capacity(count);
        for index in 0..count {
            let key = self.string(&|| format!("the key of metadata entry {index}"))?;
            let kind = self.u32(&|| format!("the type of metadata `{key}`"))?;
            let value = self.value(kind, &key)?;
            metadata.insert(key, value);
        }
        Ok(metadata)
    }

    /// Entry `index` of the tensor table, as written (not yet checked
    /// against the file).
    fn tensor_entry(&mut self, index: usize) -> Result<TensorEntry, GgufError> {
        let name = self.string(&|| format!("the name of tensor {index}"))?;
        let what = || format!("the entry of tensor `{name}`");
        let n_dims = self.u32(&what)?;
        if n_dims > 4 {
            return Err(GgufError::BadTensor {
                name,
                kind: GgmlType::Other(u32::MAX),
                detail: format!("{n_dims} dimensions (GGUF allows at most 4)"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&what)?);
        }
        let kind = GgmlType::from_id(self.u32(&what)?);
        let offset = self.u64(&what)?;
        Ok(TensorEntry {
            name,
            dims,
            kind,
            offset,
        })
    }
}

/// `general.alignment` when given (a power of two), else the default.
fn alignment(metadata: &HashMap<String, MetaValue>) -> Result<usize, GgufError> {
    match metadata.get("general.alignment") {
        Some(value) => {
            let a = value.as_f64().unwrap_or(0.0) as u64;
            if a == 0 || !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(a));
            }
            Ok(a as usize)
        }
        None => Ok(DEFAULT_ALIGNMENT),
    }
}

/// One tensor-table entry as read: `offset` is relative to the data section.
struct TensorEntry {
    name: String,
    dims: Vec<u64>,
    kind: GgmlType,
    offset: u64,
}

impl TensorEntry {
    /// The tensor's place in a file of `file_len` bytes whose data section
    /// starts at `data_start`: its size follows from its type and shape, and
    /// it must be aligned and lie inside the file.
    fn locate(
        self,
        file_len: usize,
        data_start: usize,
        alignment: usize,
    ) -> Result<TensorInfo, GgufError> {
        let TensorEntry {
            name,
            dims,
            kind,
            offset,
        } = self;
        let bad = |detail: String| GgufError::BadTensor {
            name: name.clone(),
            kind,
            detail,
        };
        let elements = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .filter(|&n| n <= file_len as u64 * 8)
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
        if end > file_len as u64 {
            return Err(GgufError::Truncated {
                what: format!("the data of tensor `{name}` ({kind})"),
                offset: start.min(file_len as u64) as usize,
                needed: size,
                available: file_len.saturating_sub(start as usize),
            });
        }
        Ok(TensorInfo {
            name,
            dims,
            kind,
            offset: start as usize,
            size: size as usize,
        })
    }
}
