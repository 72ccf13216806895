//! Prompt caches: a prompt's keys and values kept so that the next prompt
//! starting with the same tokens skips their prefill.
//!
//! Two tiers share one representation (a [`KvCache`] plus the tokens it
//! covers): [`memory::MemoryCache`], an LRU bounded by bytes that every
//! engine keeps, and [`store::CacheStore`], a directory of page-aligned files
//! ([`file`]) that survive restarts: named caches saved through the API, and
//! automatic ones for long prompts when configured. A file is matched by its
//! header alone and mapped copy-on-write when used.
//!
//! Every cache has an owner, the tenant whose request made it, and a request
//! carries a [`CacheScope`]: it reuses only its own tenant's prefixes (unless
//! the operator shares them across tenants), so `cached_tokens` never tells
//! one tenant how much of its prompt another tenant sent before.

pub mod file;
pub mod memory;
pub mod store;
pub mod tensors;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

pub use file::CacheFileError;
pub use store::{CacheInfo, CacheStore, SaveError};

/// What a cache's keys and values depend on. A file made under another
/// fingerprint would silently produce wrong tokens, so it is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// The id the model was served under when the cache was made (shown,
    /// not compared: the same weights may be served under another alias).
    pub model: String,
    pub architecture: String,
    /// Digest of the weight files (sizes and sampled bytes).
    pub weights: String,
    /// `affine-4bit-g32`, `affine-8bit-g64` or `dense`.
    pub quantization: String,
    /// The cache tensors' dtype (`float32`, `float16`, `bfloat16`).
    pub dtype: String,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The adapter set in effect (`""` for the base model; `a+b` stacked).
    pub adapters: String,
}

impl Fingerprint {
    /// Why a cache made under `self` cannot serve `model`, or `None`.
    pub fn mismatch(&self, model: &Fingerprint) -> Option<String> {
        let differs = |what: &str, file: &dyn std::fmt::Display, here: &dyn std::fmt::Display| {
            Some(format!("its {what} is {file}, the model's is {here}"))
        };
        if self.architecture != model.architecture {
            return differs("architecture", &self.architecture, &model.architecture);
        }
        if (self.layers, self.kv_heads, self.head_dim)
            != (model.layers, model.kv_heads, model.head_dim)
        {
            return Some(format!(
                "it has {} layers of {}x{} keys, the model {} layers of {}x{}",
                self.layers,
                self.kv_heads,
                self.head_dim,
                model.layers,
                model.kv_heads,
                model.head_dim
            ));
        }
        if self.dtype != model.dtype {
            return differs("dtype", &self.dtype, &model.dtype);
        }
        if self.quantization != model.quantization {
            return differs("quantization", &self.quantization, &model.quantization);
        }
        if self.weights != model.weights {
            return Some(format!(
                "it was made with the weights of `{}` (digest {}), which differ from `{}`'s ({})",
                self.model, self.weights, model.model, model.weights
            ));
        }
        if self.adapters != model.adapters {
            let name = |a: &str| {
                if a.is_empty() {
                    "no adapter".to_owned()
                } else {
                    format!("adapters `{a}`")
                }
            };
            return Some(format!(
                "it was made with {}, the request uses {}",
                name(&self.adapters),
                name(&model.adapters)
            ));
        }
        None
    }

    /// Bytes per element of `dtype`, or `None` for one we never write.
    pub fn dtype_size(&self) -> Option<usize> {
        match self.dtype.as_str() {
            "float32" => Some(4),
            "float16" | "bfloat16" => Some(2),
            _ => None,
        }
    }

    /// The same model with another adapter set.
    pub fn with_adapters(&self, adapters: &str) -> Fingerprint {
        Fingerprint {
            adapters: adapters.to_owned(),
            ..self.clone()
        }
    }
}

/// Whose prompt caches a request may reuse, and who owns the caches it
/// fills. The HTTP layer builds one per request from the caller; in-process
/// callers (tests, benchmarks, tools) act as the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheScope {
    /// The caller's tenant, recorded as the owner of what it caches;
    /// `None` is the operator, whose caches (like files written before
    /// caches had owners) belong to no tenant.
    pub tenant: Option<String>,
    /// Reuse in-memory and automatic prefixes whoever cached them (the
    /// operator's `[prompt_cache] share_across_tenants`).
    pub share: bool,
    /// Use, overwrite, delete and list every tenant's named caches, and reuse
    /// ownerless files automatically (admin-scope callers, the operator).
    pub admin: bool,
}

impl CacheScope {
    /// In-process callers: full access, caches without an owner.
    pub fn operator() -> CacheScope {
        CacheScope {
            tenant: None,
            share: false,
            admin: true,
        }
    }

    /// A tenant's request; `admin` for admin-scope callers.
    pub fn tenant(tenant: &str, share: bool, admin: bool) -> CacheScope {
        CacheScope {
            tenant: Some(tenant.to_owned()),
            share,
            admin,
        }
    }

    /// Whether a prefix cached by `owner` may be reused automatically (memory
    /// tier, automatic files): one's own, anyone's when shared, and ownerless
    /// ones for admins.
    pub fn reuses(&self, owner: Option<&str>) -> bool {
        self.share || owner == self.tenant.as_deref() || (self.admin && owner.is_none())
    }

    /// Whether a named cache owned by `owner` may be used, listed, replaced or
    /// deleted by this caller: its owner's, and every one for admins.
    pub fn may_access(&self, owner: Option<&str>) -> bool {
        self.admin || owner == self.tenant.as_deref()
    }
}

/// How an engine caches prompts.
#[derive(Clone, Default)]
pub struct PromptCacheOptions {
    /// Bytes of keys and values the in-memory LRU may hold; 0 turns it off.
    pub memory_bytes: usize,
    /// The directory of cache files (named and automatic), if any.
    pub store: Option<Arc<CacheStore>>,
    /// Persist the cache of every prompt at least this long (automatic mode);
    /// `None` turns it off.
    pub auto_save_min_tokens: Option<usize>,
}

/// Where a request's reused prefix came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSource {
    Memory,
    Disk,
}

/// Counters for `/metrics`, shared by an engine thread and its handles.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub memory_hits: AtomicU64,
    pub disk_hits: AtomicU64,
    pub misses: AtomicU64,
    /// Prompt tokens whose prefill was skipped.
    pub reused_tokens: AtomicU64,
    /// Bytes held by the in-memory cache now.
    pub memory_bytes: AtomicU64,
    pub memory_entries: AtomicU64,
    /// Cache files written automatically.
    pub auto_saves: AtomicU64,
}

impl CacheStats {
    pub fn record(&self, source: Option<CacheSource>, reused: usize) {
        let counter = match source {
            Some(CacheSource::Memory) => &self.memory_hits,
            Some(CacheSource::Disk) => &self.disk_hits,
            None => &self.misses,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.reused_tokens
            .fetch_add(reused as u64, Ordering::Relaxed);
    }

    /// A plain copy of the counters.
    pub fn snapshot(&self) -> CacheStatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CacheStatsSnapshot {
            memory_hits: get(&self.memory_hits),
            disk_hits: get(&self.disk_hits),
            misses: get(&self.misses),
            reused_tokens: get(&self.reused_tokens),
            memory_bytes: get(&self.memory_bytes),
            memory_entries: get(&self.memory_entries),
            auto_saves: get(&self.auto_saves),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStatsSnapshot {
    pub memory_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
    pub reused_tokens: u64,
    pub memory_bytes: u64,
    pub memory_entries: u64,
    pub auto_saves: u64,
}

/// Length of the common prefix of two token lists.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A digest identifying a model's weights without reading them all: for
/// each weight file (the GGUF, or a directory's `config.json` and
/// `*.safetensors`), its name, size and first and last MiB. Enough to tell
/// apart checkpoints, quantizations and conversions; cheap at load.
pub fn weights_digest(path: &std::path::Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    const SAMPLE: u64 = 1024 * 1024;
    let mut files: Vec<std::path::PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.extension().is_some_and(|e| e == "safetensors")
                            || p.file_name().is_some_and(|n| n == "config.json")
                    })
                    .collect()
            })
            .unwrap_or_default()
    } else {
        vec![path.to_owned()]
    };
    files.sort();
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for file in files {
        let Ok(mut handle) = std::fs::File::open(&file) else {
            continue;
        };
        let len = handle.metadata().map_or(0, |m| m.len());
        hasher.update(file.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
        hasher.update(&len.to_le_bytes());
        let mut buffer = Vec::new();
        let _ = (&mut handle).take(SAMPLE).read_to_end(&mut buffer);
        if len > SAMPLE && handle.seek(SeekFrom::Start(len - SAMPLE)).is_ok() {
            let _ = handle.take(SAMPLE).read_to_end(&mut buffer);
        }
        hasher.update(&buffer);
    }
    format!("{:016x}", hasher.digest())
}
