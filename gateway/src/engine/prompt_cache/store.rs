//! The disk tier: a directory of cache files (`<name>.kv`) and an index of
//! their headers, read once at open and kept current by every save and
//! delete through this store. Matching a prompt against every file is a
//! scan of token lists in memory; no tensor byte is read until a file is used.
//!
//! Named caches are saved through the API; automatic ones (`auto-<digest>`)
//! by the engine for long prompts, and only those are removed when the
//! automatic files outgrow their disk budget (oldest first).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use xxhash_rust::xxh3::xxh3_64;

use super::file::{self, CacheFileError, FileHeader, LayerBytes, MappedFile};
use super::{Fingerprint, common_prefix};

/// Prefix of automatically saved caches' names.
pub const AUTO_PREFIX: &str = "auto-";
const EXTENSION: &str = "kv";

/// One file of the store, as listed by the API.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheInfo {
    pub name: String,
    /// The model id the cache was made with.
    pub model: String,
    pub adapters: String,
    pub tokens: usize,
    /// Size of the file.
    pub bytes: u64,
    /// Unix seconds.
    pub created: u64,
    /// Saved automatically (may be removed to stay within the disk budget).
    pub auto: bool,
}

struct Indexed {
    name: String,
    path: PathBuf,
    header: Arc<FileHeader>,
    file_len: u64,
}

impl Indexed {
    fn info(&self) -> CacheInfo {
        CacheInfo {
            name: self.name.clone(),
            model: self.header.fingerprint.model.clone(),
            adapters: self.header.fingerprint.adapters.clone(),
            tokens: self.header.tokens.len(),
            bytes: self.file_len,
            created: self.header.created,
            auto: self.name.starts_with(AUTO_PREFIX),
        }
    }
}

/// A file whose tokens start a prompt.
pub struct DiskMatch {
    pub name: String,
    pub path: PathBuf,
    /// Tokens of the prompt the file covers.
    pub tokens: usize,
}

pub struct CacheStore {
    dir: PathBuf,
    index: RwLock<Vec<Indexed>>,
    /// Disk the automatic files may use.
    auto_budget_bytes: u64,
}

/// Checks a cache name: 1 to 64 of `A-Z a-z 0-9 . _ -`, not starting with a
/// dot (so it is always a plain file name inside the store).
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid prompt cache name `{name}`: use 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'"
        ))
    }
}

impl CacheStore {
    /// Opens (creating) `dir` and indexes the headers of its `.kv` files.
    /// Files that cannot be read are logged and left out, never fatal.
    pub fn open(dir: &Path, auto_budget_bytes: u64) -> std::io::Result<CacheStore> {
        std::fs::create_dir_all(dir)?;
        let mut index = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != EXTENSION) {
                continue;
            }
            let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else {
                continue;
            };
            match file::read_header(&path) {
                Ok(info) => index.push(Indexed {
                    name,
                    path,
                    header: Arc::new(info.header),
                    file_len: info.file_len,
                }),
                Err(error) => tracing::warn!(%error, "skipping unreadable prompt cache file"),
            }
        }
        index.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(CacheStore {
            dir: dir.to_owned(),
            index: RwLock::new(index),
            auto_budget_bytes,
        })
    }

    fn path_of(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.{EXTENSION}"))
    }

    /// Every indexed file, by name.
    pub fn list(&self) -> Vec<CacheInfo> {
        self.read().iter().map(Indexed::info).collect()
    }

    pub fn get(&self, name: &str) -> Option<CacheInfo> {
        self.read()
            .iter()
            .find(|e| e.name == name)
            .map(Indexed::info)
    }

    /// The header and path of a named file.
    pub fn header(&self, name: &str) -> Option<(PathBuf, Arc<FileHeader>)> {
        self.read()
            .iter()
            .find(|e| e.name == name)
            .map(|e| (e.path.clone(), Arc::clone(&e.header)))
    }

    /// Removes a file; false when there was none of that name. A request
    /// using it goes on: its mapping outlives the unlink.
    pub fn delete(&self, name: &str) -> std::io::Result<bool> {
        let mut index = self.write();
        let Some(at) = index.iter().position(|e| e.name == name) else {
            return Ok(false);
        };
        match std::fs::remove_file(&index[at].path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        index.remove(at);
        Ok(true)
    }

    /// The file sharing the longest prefix with `prompt` among those made
    /// under `fingerprint` (at most `limit` tokens of it).
    pub fn best_prefix(
        &self,
        fingerprint: &Fingerprint,
        prompt: &[u32],
        limit: usize,
    ) -> Option<DiskMatch> {
        let index = self.read();
        index
            .iter()
            .filter(|e| e.header.fingerprint.mismatch(fingerprint).is_none())
            .map(|e| (e, common_prefix(&e.header.tokens, prompt).min(limit)))
            .filter(|&(e, tokens)| tokens > 0 && file_reusable(&e.header, tokens))
            .max_by_key(|&(_, tokens)| tokens)
            .map(|(e, tokens)| DiskMatch {
                name: e.name.clone(),
                path: e.path.clone(),
                tokens,
            })
    }

    /// Whether some file already holds all of `tokens` under `fingerprint`.
    pub fn covers(&self, fingerprint: &Fingerprint, tokens: &[u32]) -> bool {
        self.read().iter().any(|e| {
            e.header.fingerprint.mismatch(fingerprint).is_none()
                && e.header.tokens.starts_with(tokens)
        })
    }

    /// Writes (or replaces) the file `name` and indexes it.
    pub fn save(
        &self,
        name: &str,
        fingerprint: &Fingerprint,
        tokens: &[u32],
        layers: &[LayerBytes],
    ) -> Result<CacheInfo, CacheFileError> {
        validate_name(name).map_err(|e| CacheFileError::Io(self.path_of(name), e))?;
        let path = self.path_of(name);
        let created = crate::http::openai::now_secs();
        let header = file::write(&path, name, created, fingerprint, tokens, layers)?;
        let file_len = std::fs::metadata(&path)
            .map_err(|e| CacheFileError::Io(path.clone(), e.to_string()))?
            .len();
        let entry = Indexed {
            name: name.to_owned(),
            path,
            header: Arc::new(header),
            file_len,
        };
        let info = entry.info();
        {
            let mut index = self.write();
            index.retain(|e| e.name != name);
            let at = index.partition_point(|e| e.name.as_str() < name);
            index.insert(at, entry);
        }
        if info.auto {
            self.enforce_auto_budget(name);
        }
        Ok(info)
    }

    /// The name an automatic cache of `tokens` gets.
    pub fn auto_name(fingerprint: &Fingerprint, tokens: &[u32]) -> String {
        let mut bytes = serde_json::to_vec(fingerprint).unwrap_or_default();
        bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        format!("{AUTO_PREFIX}{:016x}", xxh3_64(&bytes))
    }

    /// Drops the oldest automatic files (never `keep`) until they fit.
    fn enforce_auto_budget(&self, keep: &str) {
        loop {
            let victim = {
                let index = self.read();
                let autos: Vec<&Indexed> = index
                    .iter()
                    .filter(|e| e.name.starts_with(AUTO_PREFIX))
                    .collect();
                let used: u64 = autos.iter().map(|e| e.file_len).sum();
                if used <= self.auto_budget_bytes {
                    return;
                }
                autos
                    .iter()
                    .filter(|e| e.name != keep)
                    .min_by_key(|e| e.header.created)
                    .map(|e| e.name.clone())
            };
            let Some(victim) = victim else { return };
            tracing::info!(cache = %victim, "removing an automatic prompt cache to stay within the disk budget");
            if self.delete(&victim).is_err() {
                return;
            }
        }
    }

    /// Maps a file and checks it against `fingerprint`.
    pub fn open_file(path: &Path, fingerprint: &Fingerprint) -> Result<MappedFile, CacheFileError> {
        let mapped = MappedFile::open(path)?;
        if let Some(detail) = mapped.info.header.fingerprint.mismatch(fingerprint) {
            return Err(CacheFileError::WrongModel {
                path: path.to_owned(),
                detail,
            });
        }
        Ok(mapped)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Indexed>> {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Indexed>> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether a file's cache can be cut back to `tokens` (see `KvCache::reusable`).
pub fn file_reusable(header: &FileHeader, tokens: usize) -> bool {
    let rotated = header.layers.iter().any(|l| l.start > 0);
    tokens <= header.tokens.len() && (!rotated || tokens == header.tokens.len())
}
