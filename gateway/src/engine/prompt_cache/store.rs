//! The disk tier: a directory of cache files (`<name>.kv`) and an index of
//! their headers, read once at open and kept current by every save and
//! delete through this store. Matching a prompt against every file is a
//! scan of token lists in memory; no tensor byte is read until a file is used.
//!
//! Named caches are saved through the API; automatic ones (`auto-<digest>`)
//! by the engine for long prompts, and only those are removed when the
//! automatic files outgrow their disk budget (oldest first).
//!
//! Every file records its owner (the tenant that made it) in its header.
//! Callers pass a [`CacheScope`]: a tenant sees, uses, replaces and deletes
//! only its own files (admins all of them), automatic reuse matches only its
//! own (unless shared), and each tenant's named files share one disk budget.
//! Files without an owner (the operator's, or written before owners
//! existed) belong to admins only.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use xxhash_rust::xxh3::xxh3_64;

use super::file::{self, CacheFileError, FileHeader, LayerBytes, MappedFile, Planned};
use super::{CacheScope, Fingerprint, common_prefix};

/// Prefix of automatically saved caches' names.
pub const AUTO_PREFIX: &str = "auto-";
const EXTENSION: &str = "kv";

/// One file of the store, as listed by the API.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheInfo {
    pub name: String,
    /// The tenant that made it; `None`: admins only.
    pub owner: Option<String>,
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
    fn owner(&self) -> Option<&str> {
        self.header.owner.as_deref()
    }

    fn is_auto(&self) -> bool {
        self.name.starts_with(AUTO_PREFIX)
    }

    fn info(&self) -> CacheInfo {
        CacheInfo {
            name: self.name.clone(),
            owner: self.header.owner.clone(),
            model: self.header.fingerprint.model.clone(),
            adapters: self.header.fingerprint.adapters.clone(),
            tokens: self.header.tokens.len(),
            bytes: self.file_len,
            created: self.header.created,
            auto: self.is_auto(),
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
    /// Disk each tenant's named files may use.
    named_budget_bytes: u64,
    /// Held by [`CacheStore::save_named`] from its checks to its index
    /// update, so two saves cannot both fit the same budget or take the
    /// same name (lookups use `index` and never wait on a write).
    named_saves: Mutex<()>,
}

/// Why [`CacheStore::save_named`] refused or failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum SaveError {
    /// Another tenant's cache has this name (compared without case, as a
    /// case-insensitive file system would).
    #[error(
        "the prompt cache name `{0}` is taken by a cache you cannot replace; choose another name"
    )]
    NameTaken(String),
    /// The file would take the tenant's named caches over their budget.
    #[error(
        "saving `{name}` needs {needed} bytes, but your named prompt caches already use {used} of the {budget} bytes allowed ([prompt_cache] named_disk_mb); delete some (DELETE /v1/prompt_caches/<name>{largest}) or save a shorter prompt"
    )]
    OverBudget {
        name: String,
        needed: u64,
        used: u64,
        budget: u64,
        /// `; largest: a (n bytes), b (m bytes)` or empty.
        largest: String,
    },
    #[error(transparent)]
    File(#[from] CacheFileError),
}

/// Checks the name of a cache a client saves: a valid name (see
/// [`validate_name`]) outside the reserved `auto-` prefix of automatic
/// caches (checked without case, as a case-insensitive file system would).
pub fn validate_new_name(name: &str) -> Result<(), String> {
    validate_name(name)?;
    let reserved = name
        .get(..AUTO_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(AUTO_PREFIX));
    if reserved {
        return Err(format!(
            "invalid prompt cache name `{name}`: names starting with `{AUTO_PREFIX}` are reserved for automatic caches; choose another name"
        ));
    }
    Ok(())
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
    /// Named files have no budget until [`CacheStore::with_named_budget`].
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
            named_budget_bytes: u64::MAX,
            named_saves: Mutex::new(()),
        })
    }

    /// Sets the disk each tenant's named files may use.
    pub fn with_named_budget(mut self, bytes: u64) -> CacheStore {
        self.named_budget_bytes = bytes;
        self
    }

    fn path_of(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.{EXTENSION}"))
    }

    /// Every indexed file, by name (all owners: for metrics and admins).
    pub fn list(&self) -> Vec<CacheInfo> {
        self.read().iter().map(Indexed::info).collect()
    }

    /// The files `scope` may see: its tenant's own, every one for admins.
    pub fn list_for(&self, scope: &CacheScope) -> Vec<CacheInfo> {
        self.read()
            .iter()
            .filter(|e| scope.may_access(e.owner()))
            .map(Indexed::info)
            .collect()
    }

    /// A file `scope` may see; another tenant's is `None`, as if absent.
    pub fn get_for(&self, name: &str, scope: &CacheScope) -> Option<CacheInfo> {
        self.read()
            .iter()
            .find(|e| e.name == name && scope.may_access(e.owner()))
            .map(Indexed::info)
    }

    /// The header and path of a file `scope` may use (`None` when there is
    /// none of that name or it is another tenant's).
    pub fn header_for(&self, name: &str, scope: &CacheScope) -> Option<(PathBuf, Arc<FileHeader>)> {
        self.read()
            .iter()
            .find(|e| e.name == name && scope.may_access(e.owner()))
            .map(|e| (e.path.clone(), Arc::clone(&e.header)))
    }

    /// Removes a file `scope` may access; false when there is none of that
    /// name or it is another tenant's.
    pub fn delete_for(&self, name: &str, scope: &CacheScope) -> std::io::Result<bool> {
        self.delete_where(name, |e| scope.may_access(e.owner()))
    }

    /// Removes a file; false when there was none of that name. A request
    /// using it goes on: its mapping outlives the unlink.
    fn delete(&self, name: &str) -> std::io::Result<bool> {
        self.delete_where(name, |_| true)
    }

    fn delete_where(
        &self,
        name: &str,
        allowed: impl Fn(&Indexed) -> bool,
    ) -> std::io::Result<bool> {
        let mut index = self.write();
        let Some(at) = index.iter().position(|e| e.name == name && allowed(e)) else {
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
    /// under `fingerprint` that `scope` reuses (at most `limit` tokens of it).
    pub fn best_prefix(
        &self,
        scope: &CacheScope,
        fingerprint: &Fingerprint,
        prompt: &[u32],
        limit: usize,
    ) -> Option<DiskMatch> {
        let index = self.read();
        index
            .iter()
            .filter(|e| {
                scope.reuses(e.owner()) && e.header.fingerprint.mismatch(fingerprint).is_none()
            })
            .map(|e| (e, common_prefix(&e.header.tokens, prompt).min(limit)))
            .filter(|&(e, tokens)| tokens > 0 && file_reusable(&e.header, tokens))
            .max_by_key(|&(_, tokens)| tokens)
            .map(|(e, tokens)| DiskMatch {
                name: e.name.clone(),
                path: e.path.clone(),
                tokens,
            })
    }

    /// Whether some file `scope` reuses already holds all of `tokens` under
    /// `fingerprint`.
    pub fn covers(&self, scope: &CacheScope, fingerprint: &Fingerprint, tokens: &[u32]) -> bool {
        self.read().iter().any(|e| {
            scope.reuses(e.owner())
                && e.header.fingerprint.mismatch(fingerprint).is_none()
                && e.header.tokens.starts_with(tokens)
        })
    }

    /// Writes (or replaces) the file `name`, owned by `owner`, and indexes
    /// it: automatic files and the operator's; no ownership or named budget
    /// check (see [`CacheStore::save_named`]).
    pub fn save(
        &self,
        name: &str,
        owner: Option<&str>,
        fingerprint: &Fingerprint,
        tokens: &[u32],
        layers: &[LayerBytes],
    ) -> Result<CacheInfo, CacheFileError> {
        let plan = self.plan(name, owner, fingerprint, tokens, layers)?;
        self.write_planned(name, plan, layers)
    }

    /// Saves a client's named cache as `scope`'s tenant's: refused when the
    /// name (compared without case) is another tenant's that `scope` may not
    /// replace, or when the file would take the tenant's named files over
    /// their disk budget. The name must pass [`validate_new_name`].
    pub fn save_named(
        &self,
        name: &str,
        scope: &CacheScope,
        fingerprint: &Fingerprint,
        tokens: &[u32],
        layers: &[LayerBytes],
    ) -> Result<CacheInfo, SaveError> {
        validate_new_name(name).map_err(|e| CacheFileError::Io(self.path_of(name), e))?;
        let _serial = self.named_saves.lock().unwrap_or_else(|e| e.into_inner());
        self.check_name(name, scope)?;
        let owner = scope.tenant.as_deref();
        let plan = self.plan(name, owner, fingerprint, tokens, layers)?;
        let needed = plan.file_len();
        let (used, mut theirs) = {
            let index = self.read();
            let theirs: Vec<(String, u64)> = index
                .iter()
                .filter(|e| !e.is_auto() && e.owner() == owner && e.name != name)
                .map(|e| (e.name.clone(), e.file_len))
                .collect();
            (theirs.iter().map(|t| t.1).sum::<u64>(), theirs)
        };
        if used.saturating_add(needed) > self.named_budget_bytes {
            theirs.sort_by_key(|t| std::cmp::Reverse(t.1));
            let largest = theirs
                .iter()
                .take(3)
                .map(|(n, b)| format!("{n} ({b} bytes)"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(SaveError::OverBudget {
                name: name.to_owned(),
                needed,
                used,
                budget: self.named_budget_bytes,
                largest: if largest.is_empty() {
                    String::new()
                } else {
                    format!("; your largest: {largest}")
                },
            });
        }
        Ok(self.write_planned(name, plan, layers)?)
    }

    /// `Err(NameTaken)` when a file named `name` (without case) exists that
    /// `scope` may not replace. A cheap check before the work of a save;
    /// [`CacheStore::save_named`] checks again.
    pub fn check_name(&self, name: &str, scope: &CacheScope) -> Result<(), SaveError> {
        let taken = self
            .read()
            .iter()
            .any(|e| e.name.eq_ignore_ascii_case(name) && !scope.may_access(e.owner()));
        if taken {
            return Err(SaveError::NameTaken(name.to_owned()));
        }
        Ok(())
    }

    fn plan(
        &self,
        name: &str,
        owner: Option<&str>,
        fingerprint: &Fingerprint,
        tokens: &[u32],
        layers: &[LayerBytes],
    ) -> Result<Planned, CacheFileError> {
        validate_name(name).map_err(|e| CacheFileError::Io(self.path_of(name), e))?;
        let created = crate::util::time::unix_secs();
        Planned::new(name, owner, created, fingerprint, tokens, layers)
            .map_err(|e| CacheFileError::Io(self.path_of(name), e))
    }

    fn write_planned(
        &self,
        name: &str,
        plan: Planned,
        layers: &[LayerBytes],
    ) -> Result<CacheInfo, CacheFileError> {
        let path = self.path_of(name);
        let header = plan.write(&path, layers)?;
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

    /// The name an automatic cache of `tokens` made for `owner` gets (two
    /// tenants' caches of one prompt are two files: neither replaces the
    /// other's).
    pub fn auto_name(fingerprint: &Fingerprint, owner: Option<&str>, tokens: &[u32]) -> String {
        let mut bytes = serde_json::to_vec(fingerprint).unwrap_or_default();
        if let Some(owner) = owner {
            bytes.extend((owner.len() as u64).to_le_bytes());
            bytes.extend(owner.as_bytes());
        }
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
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            adapters: String::new(),
        }
    }

    /// One layer's cache of `n` tokens: 2 tensors of 16 n bytes.
    fn layers(n: usize) -> Vec<LayerBytes> {
        vec![LayerBytes {
            window: None,
            start: 0,
            shape: vec![1, 1, n, 4],
            keys: vec![1; n * 16],
            values: vec![2; n * 16],
        }]
    }

    fn tokens(n: usize) -> Vec<u32> {
        (1..=n as u32).collect()
    }

    fn tenant(t: &str) -> CacheScope {
        CacheScope::tenant(t, false, false)
    }

    fn names(infos: Vec<CacheInfo>) -> Vec<String> {
        infos.into_iter().map(|i| i.name).collect()
    }

    #[test]
    fn named_caches_belong_to_their_tenant() {
        let dir = tempfile::tempdir().unwrap();
        let store = CacheStore::open(dir.path(), u64::MAX).unwrap();
        let (a, b) = (tenant("a"), tenant("b"));
        let admin = CacheScope::tenant("ops", false, true);
        let fp = fingerprint();
        store
            .save_named("mine", &a, &fp, &tokens(3), &layers(3))
            .unwrap();
        store
            .save("old", None, &fp, &tokens(3), &layers(3))
            .unwrap();

        assert_eq!(names(store.list_for(&a)), ["mine"]);
        assert!(store.list_for(&b).is_empty());
        assert_eq!(names(store.list_for(&admin)), ["mine", "old"]);
        assert_eq!(
            store.get_for("mine", &a).unwrap().owner.as_deref(),
            Some("a")
        );
        assert!(store.get_for("mine", &b).is_none());
        assert!(store.header_for("mine", &b).is_none());
        assert!(
            store.header_for("old", &a).is_none(),
            "ownerless: admins only"
        );
        assert!(store.header_for("old", &admin).is_some());

        // B can neither replace (any case) nor delete it; A and admins can.
        for name in ["mine", "MINE"] {
            assert_eq!(
                store.save_named(name, &b, &fp, &tokens(2), &layers(2)),
                Err(SaveError::NameTaken(name.into()))
            );
        }
        assert!(!store.delete_for("mine", &b).unwrap());
        assert_eq!(store.get_for("mine", &a).unwrap().tokens, 3);
        store
            .save_named("mine", &a, &fp, &tokens(2), &layers(2))
            .unwrap();
        assert!(store.delete_for("mine", &admin).unwrap());
        assert!(store.delete_for("old", &admin).unwrap());
        assert!(store.list().is_empty());

        // Reserved names are refused, whatever their case.
        for name in ["auto-x", "AUTO-x"] {
            assert!(validate_new_name(name).unwrap_err().contains("reserved"));
            assert!(
                store
                    .save_named(name, &a, &fp, &tokens(2), &layers(2))
                    .is_err()
            );
        }
        assert!(validate_new_name("autos").is_ok());
    }

    #[test]
    fn each_tenant_has_a_named_disk_budget() {
        let dir = tempfile::tempdir().unwrap();
        // Room for two small files (one 16 KiB page of header, one of data).
        let store = CacheStore::open(dir.path(), u64::MAX)
            .unwrap()
            .with_named_budget(4 * file::ALIGN + 100);
        let (a, b) = (tenant("a"), tenant("b"));
        let fp = fingerprint();
        store
            .save_named("one", &a, &fp, &tokens(3), &layers(3))
            .unwrap();
        store
            .save_named("two", &a, &fp, &tokens(3), &layers(3))
            .unwrap();
        let err = store
            .save_named("three", &a, &fp, &tokens(3), &layers(3))
            .unwrap_err();
        assert!(matches!(err, SaveError::OverBudget { .. }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains("named_disk_mb") && message.contains("one ("),
            "{message}"
        );
        assert!(store.get_for("three", &a).is_none(), "nothing written");
        // Replacing a file counts it once; another tenant has its own budget;
        // automatic files do not count.
        store
            .save_named("two", &a, &fp, &tokens(3), &layers(3))
            .unwrap();
        store
            .save_named("three", &b, &fp, &tokens(3), &layers(3))
            .unwrap();
        let auto = CacheStore::auto_name(&fp, Some("a"), &tokens(5));
        store
            .save(&auto, Some("a"), &fp, &tokens(5), &layers(5))
            .unwrap();
        store.delete_for("one", &a).unwrap();
        store
            .save_named("four", &a, &fp, &tokens(3), &layers(3))
            .unwrap();
    }

    #[test]
    fn automatic_reuse_stays_within_a_tenant_unless_shared() {
        let dir = tempfile::tempdir().unwrap();
        let store = CacheStore::open(dir.path(), u64::MAX).unwrap();
        let fp = fingerprint();
        let prompt = tokens(6);
        let name = CacheStore::auto_name(&fp, Some("a"), &prompt[..4]);
        assert_ne!(name, CacheStore::auto_name(&fp, Some("b"), &prompt[..4]));
        store
            .save(&name, Some("a"), &fp, &prompt[..4], &layers(4))
            .unwrap();

        let (a, b) = (tenant("a"), tenant("b"));
        assert_eq!(store.best_prefix(&a, &fp, &prompt, 5).unwrap().tokens, 4);
        assert!(store.covers(&a, &fp, &prompt[..3]));
        assert!(store.best_prefix(&b, &fp, &prompt, 5).is_none());
        assert!(!store.covers(&b, &fp, &prompt[..3]));
        // Admins are a tenant like any other here.
        let admin = CacheScope::tenant("ops", false, true);
        assert!(store.best_prefix(&admin, &fp, &prompt, 5).is_none());
        let shared = CacheScope::tenant("b", true, false);
        assert_eq!(
            store.best_prefix(&shared, &fp, &prompt, 5).unwrap().tokens,
            4
        );
    }
}
