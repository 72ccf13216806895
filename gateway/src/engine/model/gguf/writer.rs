//! Writing a GGUF v3 file from metadata and already-encoded tensors: test
//! fixtures and tools; the gateway itself only reads GGUF.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use super::{DEFAULT_ALIGNMENT, GgmlType, MAGIC, MetaValue};

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
