//! The on-disk prompt-cache format: a small binary preamble, a JSON header,
//! then every tensor at a 16 KiB-aligned offset so a file can be mapped and
//! handed to MLX without copying (the layout of mlx-bun's `kv-store.ts`, with
//! a version, a model fingerprint and checksums added):
//!
//! ```text
//! [magic "MLXGATEKV\n"][u32 LE header length][u32 LE data start][u64 LE xxh3 of header]
//! [JSON header][zero padding to data start]
//! [tensor bytes at data start + offset, every offset a multiple of 16 KiB]
//! ```
//!
//! Reading the header alone is cheap (one small read), so the prefix index
//! scans many files without touching their tensors. Mapping checks every
//! tensor's bounds, size and xxh3 before MLX sees a byte: a truncated,
//! corrupted or foreign file is an error naming what is wrong, never a crash.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::Fingerprint;

pub const MAGIC: &[u8; 10] = b"MLXGATEKV\n";
/// Bumped whenever the layout or the header's meaning changes.
pub const FORMAT_VERSION: u32 = 1;
/// Tensor alignment: a page on every platform MLX runs on (16 KiB on Apple
/// silicon), so each tensor can be mapped where it lies.
pub const ALIGN: u64 = 16 * 1024;
/// Bytes before the JSON header.
const PREAMBLE: usize = MAGIC.len() + 4 + 4 + 8;
/// A header larger than this is not one of ours (a 128k-token prompt is ~1 MB of JSON).
const MAX_HEADER_BYTES: u32 = 64 * 1024 * 1024;

/// Why a cache file cannot be used. Every message names the file.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum CacheFileError {
    #[error("{0}: {1}")]
    Io(PathBuf, String),
    #[error("{0} is not an mlxgate prompt cache (bad magic bytes)")]
    NotACache(PathBuf),
    #[error("{path} is truncated: {detail}")]
    Truncated { path: PathBuf, detail: String },
    #[error("{path} is corrupted: {detail}")]
    Corrupted { path: PathBuf, detail: String },
    #[error("{path} has format version {found}; this mlxgate reads version {FORMAT_VERSION}")]
    WrongVersion { path: PathBuf, found: u32 },
    #[error("{path} was made for another model: {detail}")]
    WrongModel { path: PathBuf, detail: String },
}

/// One stored tensor: where its bytes are and what they should hash to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// From the start of the data section; a multiple of [`ALIGN`].
    pub offset: u64,
    pub bytes: u64,
    /// xxh3-64 of the bytes, hex.
    pub xxh3: String,
}

/// One layer's cache: `kind` is `kv` (every position) or `rotating` (a
/// sliding-window layer holding positions `start..start + shape[2]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerEntry {
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<usize>,
    /// Absolute position of the first cached entry.
    pub start: usize,
    /// `[1, kv_heads, positions, head_dim]`, the same for keys and values.
    pub shape: Vec<usize>,
    pub keys: TensorEntry,
    pub values: TensorEntry,
}

/// The JSON header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileHeader {
    pub version: u32,
    pub name: String,
    /// The tenant that made it. Files without one (the operator's, or
    /// written before caches had owners) belong to admins only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Unix seconds.
    pub created: u64,
    pub fingerprint: Fingerprint,
    /// The tokens whose keys and values the file holds, in order.
    pub tokens: Vec<u32>,
    pub layers: Vec<LayerEntry>,
}

impl FileHeader {
    /// Bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.keys.bytes + l.values.bytes)
            .sum()
    }
}

/// A header and where the data section starts.
#[derive(Debug, Clone)]
pub struct HeaderInfo {
    pub header: FileHeader,
    pub data_start: u64,
    pub file_len: u64,
}

/// A layer's arrays as raw bytes, ready to write.
pub struct LayerBytes {
    pub window: Option<usize>,
    pub start: usize,
    pub shape: Vec<usize>,
    pub keys: Vec<u8>,
    pub values: Vec<u8>,
}

const fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> CacheFileError + '_ {
    move |e| CacheFileError::Io(path.to_owned(), e.to_string())
}

/// A file ready to be written: its header and where everything goes, known
/// before a byte is written (so a disk budget can be checked first).
pub struct Planned {
    pub header: FileHeader,
    json: Vec<u8>,
    data_start: u64,
    data_len: u64,
}

impl Planned {
    /// Lays out a file of `layers`; `owner` is the tenant it belongs to.
    pub fn new(
        name: &str,
        owner: Option<&str>,
        created: u64,
        fingerprint: &Fingerprint,
        tokens: &[u32],
        layers: &[LayerBytes],
    ) -> Result<Planned, String> {
        let mut entries = Vec::with_capacity(layers.len());
        let mut cursor = 0u64;
        let mut place = |bytes: &[u8]| {
            let offset = align_up(cursor);
            cursor = offset + bytes.len() as u64;
            TensorEntry {
                offset,
                bytes: bytes.len() as u64,
                xxh3: format!("{:016x}", xxh3_64(bytes)),
            }
        };
        for layer in layers {
            entries.push(LayerEntry {
                kind: if layer.window.is_some() {
                    "rotating"
                } else {
                    "kv"
                }
                .into(),
                window: layer.window,
                start: layer.start,
                shape: layer.shape.clone(),
                keys: place(&layer.keys),
                values: place(&layer.values),
            });
        }
        let header = FileHeader {
            version: FORMAT_VERSION,
            name: name.to_owned(),
            owner: owner.map(str::to_owned),
            created,
            fingerprint: fingerprint.clone(),
            tokens: tokens.to_vec(),
            layers: entries,
        };
        let json = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
        let data_start = align_up((PREAMBLE + json.len()) as u64);
        Ok(Planned {
            header,
            json,
            data_start,
            data_len: cursor,
        })
    }

    /// The size the file will have.
    pub fn file_len(&self) -> u64 {
        (self.data_start + self.data_len).max((PREAMBLE + self.json.len()) as u64)
    }

    /// Writes the file atomically: a temporary file next to `path`, fsync,
    /// rename over `path`, fsync of the directory. A crash leaves either the
    /// old file or the new one, never a torn one. `layers` are those planned.
    pub fn write(self, path: &Path, layers: &[LayerBytes]) -> Result<FileHeader, CacheFileError> {
        let Planned {
            header,
            json,
            data_start,
            ..
        } = self;
        let dir = path.parent().unwrap_or(Path::new("."));
        let file_name = path
            .file_name()
            .map_or_else(Default::default, |n| n.to_string_lossy().into_owned());
        let temp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
        let result = (|| {
            let mut file = File::create(&temp).map_err(io(&temp))?;
            let mut preamble = Vec::with_capacity(PREAMBLE + json.len());
            preamble.extend_from_slice(MAGIC);
            preamble.extend_from_slice(&(json.len() as u32).to_le_bytes());
            preamble.extend_from_slice(&(data_start as u32).to_le_bytes());
            preamble.extend_from_slice(&xxh3_64(&json).to_le_bytes());
            preamble.extend_from_slice(&json);
            file.write_all(&preamble).map_err(io(&temp))?;
            for (layer, entry) in layers.iter().zip(&header.layers) {
                for (bytes, tensor) in [(&layer.keys, &entry.keys), (&layer.values, &entry.values)]
                {
                    file.seek(SeekFrom::Start(data_start + tensor.offset))
                        .map_err(io(&temp))?;
                    file.write_all(bytes).map_err(io(&temp))?;
                }
            }
            file.sync_all().map_err(io(&temp))?;
            std::fs::rename(&temp, path).map_err(io(path))?;
            if let Ok(dir) = File::open(dir) {
                let _ = dir.sync_all();
            }
            Ok(header)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        result
    }
}

/// Plans and writes an ownerless (operator's) cache file atomically (see
/// [`Planned::write`]).
pub fn write(
    path: &Path,
    name: &str,
    created: u64,
    fingerprint: &Fingerprint,
    tokens: &[u32],
    layers: &[LayerBytes],
) -> Result<FileHeader, CacheFileError> {
    Planned::new(name, None, created, fingerprint, tokens, layers)
        .map_err(|e| CacheFileError::Io(path.into(), e))?
        .write(path, layers)
}

/// Reads and checks the preamble and JSON header only (one small read).
pub fn read_header(path: &Path) -> Result<HeaderInfo, CacheFileError> {
    let mut file = File::open(path).map_err(io(path))?;
    let file_len = file.metadata().map_err(io(path))?.len();
    let mut preamble = [0u8; PREAMBLE];
    if file_len < PREAMBLE as u64 {
        if file_len >= MAGIC.len() as u64 {
            file.read_exact(&mut preamble[..MAGIC.len()])
                .map_err(io(path))?;
            if &preamble[..MAGIC.len()] != MAGIC {
                return Err(CacheFileError::NotACache(path.into()));
            }
        }
        return Err(CacheFileError::Truncated {
            path: path.into(),
            detail: format!("{file_len} bytes, shorter than the {PREAMBLE}-byte preamble"),
        });
    }
    file.read_exact(&mut preamble).map_err(io(path))?;
    if &preamble[..MAGIC.len()] != MAGIC {
        return Err(CacheFileError::NotACache(path.into()));
    }
    let word = |at: usize| u32::from_le_bytes(preamble[at..at + 4].try_into().expect("4 bytes"));
    let header_len = word(MAGIC.len());
    let data_start = word(MAGIC.len() + 4) as u64;
    let checksum = u64::from_le_bytes(preamble[MAGIC.len() + 8..].try_into().expect("8 bytes"));
    let corrupted = |detail: String| CacheFileError::Corrupted {
        path: path.into(),
        detail,
    };
    if header_len > MAX_HEADER_BYTES
        || !data_start.is_multiple_of(ALIGN)
        || data_start < (PREAMBLE as u64 + header_len as u64)
    {
        return Err(corrupted(format!(
            "impossible preamble (header {header_len} bytes, data at {data_start})"
        )));
    }
    if file_len < PREAMBLE as u64 + header_len as u64 {
        return Err(CacheFileError::Truncated {
            path: path.into(),
            detail: format!(
                "{file_len} bytes, but the header alone needs {}",
                PREAMBLE as u64 + header_len as u64
            ),
        });
    }
    let mut json = vec![0u8; header_len as usize];
    file.read_exact(&mut json).map_err(io(path))?;
    if xxh3_64(&json) != checksum {
        return Err(corrupted("the header's checksum does not match".into()));
    }
    // Check the version before the full schema, so an older or newer file
    // says so instead of failing on a field it lacks.
    let value: serde_json::Value =
        serde_json::from_slice(&json).map_err(|e| corrupted(format!("header is not JSON: {e}")))?;
    let version = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
    if version != FORMAT_VERSION {
        return Err(CacheFileError::WrongVersion {
            path: path.into(),
            found: version,
        });
    }
    let header: FileHeader =
        serde_json::from_value(value).map_err(|e| corrupted(format!("bad header: {e}")))?;
    check_layout(path, &header, data_start, file_len)?;
    Ok(HeaderInfo {
        header,
        data_start,
        file_len,
    })
}

/// Every tensor inside the file, aligned, and as large as its shape says.
fn check_layout(
    path: &Path,
    header: &FileHeader,
    data_start: u64,
    file_len: u64,
) -> Result<(), CacheFileError> {
    let element = header
        .fingerprint
        .dtype_size()
        .ok_or_else(|| CacheFileError::Corrupted {
            path: path.into(),
            detail: format!("unknown dtype `{}`", header.fingerprint.dtype),
        })?;
    let fp = &header.fingerprint;
    if header.layers.len() != fp.layers {
        return Err(CacheFileError::Corrupted {
            path: path.into(),
            detail: format!(
                "{} layers stored, the fingerprint says {}",
                header.layers.len(),
                fp.layers
            ),
        });
    }
    for (index, layer) in header.layers.iter().enumerate() {
        let corrupted = |detail: String| CacheFileError::Corrupted {
            path: path.into(),
            detail: format!("layer {index}: {detail}"),
        };
        let consistent = matches!(layer.shape[..], [1, heads, positions, dim]
            if heads == fp.kv_heads && dim == fp.head_dim && layer.start + positions == header.tokens.len());
        if !consistent {
            return Err(corrupted(format!(
                "shape {:?} from position {} does not fit {} tokens of {}x{} keys",
                layer.shape,
                layer.start,
                header.tokens.len(),
                fp.kv_heads,
                fp.head_dim
            )));
        }
        let expected = layer.shape.iter().product::<usize>() as u64 * element as u64;
        for (what, tensor) in [("keys", &layer.keys), ("values", &layer.values)] {
            if tensor.bytes != expected {
                return Err(corrupted(format!(
                    "{what} hold {} bytes but shape {:?} of {} needs {expected}",
                    tensor.bytes, layer.shape, header.fingerprint.dtype
                )));
            }
            if !tensor.offset.is_multiple_of(ALIGN) {
                return Err(corrupted(format!(
                    "{what} offset {} is not {ALIGN}-aligned",
                    tensor.offset
                )));
            }
            let end = data_start + tensor.offset + tensor.bytes;
            if end > file_len {
                return Err(CacheFileError::Truncated {
                    path: path.into(),
                    detail: format!(
                        "layer {index} {what} end at byte {end}, the file has {file_len}"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// A cache file mapped copy-on-write, its tensors checked against their
/// checksums. Private mapping: should MLX ever write into a buffer it was
/// handed (donation), the write lands in private pages, never in the file.
pub struct MappedFile {
    pub info: HeaderInfo,
    pub map: memmap2::MmapMut,
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<MappedFile, CacheFileError> {
        let info = read_header(path)?;
        let file = File::open(path).map_err(io(path))?;
        // SAFETY: a private (copy-on-write) mapping of a file we only read;
        // should another process truncate it meanwhile, reads past the end
        // fault, which atomic renames (how we replace files) never cause.
        let map = unsafe { memmap2::MmapOptions::new().map_copy(&file) }.map_err(io(path))?;
        if (map.len() as u64) < info.file_len {
            return Err(CacheFileError::Truncated {
                path: path.into(),
                detail: "the file shrank while it was being opened".into(),
            });
        }
        let mapped = MappedFile { info, map };
        for (index, layer) in mapped.info.header.layers.iter().enumerate() {
            for (what, tensor) in [("keys", &layer.keys), ("values", &layer.values)] {
                let hash = format!("{:016x}", xxh3_64(mapped.tensor(tensor)));
                if hash != tensor.xxh3 {
                    return Err(CacheFileError::Corrupted {
                        path: path.into(),
                        detail: format!("layer {index} {what}: checksum mismatch"),
                    });
                }
            }
        }
        Ok(mapped)
    }

    /// The bytes of one tensor (bounds were checked at open).
    pub fn tensor(&self, tensor: &TensorEntry) -> &[u8] {
        let start = (self.info.data_start + tensor.offset) as usize;
        &self.map[start..start + tensor.bytes as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint() -> Fingerprint {
        Fingerprint {
            model: "m".into(),
            architecture: "llama".into(),
            weights: "0123".into(),
            quantization: "dense".into(),
            dtype: "float32".into(),
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            adapters: String::new(),
        }
    }

    /// Two layers over 3 tokens; the second a sliding layer holding 2 of them.
    fn layers() -> Vec<LayerBytes> {
        let bytes = |n: usize, seed: u8| {
            (0..n)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                .collect::<Vec<u8>>()
        };
        vec![
            LayerBytes {
                window: None,
                start: 0,
                shape: vec![1, 2, 3, 4],
                keys: bytes(96, 1),
                values: bytes(96, 2),
            },
            LayerBytes {
                window: Some(3),
                start: 1,
                shape: vec![1, 2, 2, 4],
                keys: bytes(64, 3),
                values: bytes(64, 4),
            },
        ]
    }

    fn written(dir: &Path) -> PathBuf {
        let path = dir.join("c.kv");
        write(&path, "c", 1, &fingerprint(), &[5, 6, 7], &layers()).unwrap();
        path
    }

    #[test]
    fn round_trip_is_aligned_and_exact() {
        let dir = tempfile::tempdir().unwrap();
        let path = written(dir.path());
        let info = read_header(&path).unwrap();
        assert_eq!(info.data_start % ALIGN, 0);
        assert_eq!(info.header.tokens, vec![5, 6, 7]);
        assert_eq!(info.header.layers[1].kind, "rotating");
        let mapped = MappedFile::open(&path).unwrap();
        for (entry, layer) in mapped.info.header.layers.iter().zip(layers()) {
            assert_eq!(entry.keys.offset % ALIGN, 0);
            assert_eq!(mapped.tensor(&entry.keys), &layer.keys[..]);
            assert_eq!(mapped.tensor(&entry.values), &layer.values[..]);
            assert_eq!(
                mapped.map.as_ptr() as usize % 4096,
                0,
                "mapping starts on a page"
            );
        }
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn the_owner_round_trips_and_old_headers_have_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.kv");
        let plan =
            Planned::new("o", Some("acme"), 1, &fingerprint(), &[5, 6, 7], &layers()).unwrap();
        let planned_len = plan.file_len();
        plan.write(&path, &layers()).unwrap();
        let info = read_header(&path).unwrap();
        assert_eq!(info.header.owner.as_deref(), Some("acme"));
        assert_eq!(info.file_len, planned_len, "the plan knows the size");
        // A header written before owners existed has no `owner` field.
        let path = written(dir.path());
        let json = serde_json::to_string(&read_header(&path).unwrap().header).unwrap();
        assert!(!json.contains("owner"), "{json}");
        assert_eq!(read_header(&path).unwrap().header.owner, None);
    }

    #[test]
    fn truncated_files_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = written(dir.path());
        let full = std::fs::read(&path).unwrap();
        for keep in [0, 5, 12, PREAMBLE + 10, full.len() - 1] {
            std::fs::write(&path, &full[..keep]).unwrap();
            let err = MappedFile::open(&path).err().unwrap();
            assert!(
                matches!(
                    err,
                    CacheFileError::Truncated { .. } | CacheFileError::NotACache(_)
                ),
                "{keep} bytes: {err}"
            );
        }
    }

    #[test]
    fn flipped_bytes_are_caught() {
        let dir = tempfile::tempdir().unwrap();
        let path = written(dir.path());
        let full = std::fs::read(&path).unwrap();
        let data_start = read_header(&path).unwrap().data_start as usize;
        // The magic, the header length, the header JSON, and a tensor byte.
        for at in [0, MAGIC.len(), PREAMBLE + 3, PREAMBLE + 40, data_start + 5] {
            let mut bytes = full.clone();
            bytes[at] ^= 0x20;
            std::fs::write(&path, &bytes).unwrap();
            let err = MappedFile::open(&path)
                .err()
                .unwrap_or_else(|| panic!("flip at {at} accepted"));
            assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn other_versions_and_files_are_named_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let path = written(dir.path());
        let mut header = read_header(&path).unwrap().header;
        header.version = 99;
        let json = serde_json::to_vec(&header).unwrap();
        let mut bytes = MAGIC.to_vec();
        bytes.extend((json.len() as u32).to_le_bytes());
        bytes.extend((ALIGN as u32 * 4).to_le_bytes());
        bytes.extend(xxh3_64(&json).to_le_bytes());
        bytes.extend(&json);
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            read_header(&path),
            Err(CacheFileError::WrongVersion { found: 99, .. })
        ));

        std::fs::write(
            &path,
            b"GGUF\x03\x00\x00\x00 and more bytes than a preamble",
        )
        .unwrap();
        assert!(matches!(
            read_header(&path),
            Err(CacheFileError::NotACache(_))
        ));
    }

    #[test]
    fn sizes_must_match_shape_and_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.kv");
        let mut fp = fingerprint();
        fp.dtype = "float16".into();
        let err = write(&path, "c", 1, &fp, &[5, 6, 7], &layers())
            .and_then(|_| read_header(&path))
            .unwrap_err();
        assert!(err.to_string().contains("needs"), "{err}");
    }
}
