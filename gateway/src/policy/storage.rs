//! On-disk layout under `<data_dir>/policies/`:
//!
//! ```text
//! meta/<name>.json              metadata of the current version of <name>
//! blobs/<sha256>.wasm           component bytes as uploaded
//! artifacts/<sha256>-<compat>.cwasm   precompiled code (+ .sha256 digest)
//! bindings.json                 which policy is bound for router / adapter-selector
//! ```
//!
//! Every file is written to a temporary name, synced and renamed, so a crash
//! leaves either the old or the new file. Artifacts are only deserialized if
//! their digest file, written by us next to them, matches.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::PolicyError;
use super::types::{Limits, OnError, PolicyKind};

/// Metadata of one policy version as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StoredMeta {
    pub(crate) name: String,
    pub(crate) kind: PolicyKind,
    pub(crate) sha256: String,
    pub(crate) size_bytes: u64,
    pub(crate) interface: String,
    pub(crate) limits: Limits,
    pub(crate) on_error: OnError,
    pub(crate) config: Option<String>,
    pub(crate) uploaded_at: u64,
    pub(crate) version: u64,
    /// A router's declared decision inputs (see `PolicyInfo`).
    #[serde(default)]
    pub(crate) decision_inputs: Option<Vec<String>>,
}

/// Bound policy names, by kind.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Bindings {
    #[serde(default)]
    pub(crate) router: Option<String>,
    #[serde(default)]
    pub(crate) adapter_selector: Option<String>,
}

impl Bindings {
    pub(crate) fn get(&self, kind: PolicyKind) -> Option<&String> {
        match kind {
            PolicyKind::Router => self.router.as_ref(),
            PolicyKind::AdapterSelector => self.adapter_selector.as_ref(),
            PolicyKind::DatasetTransform => None,
        }
    }

    pub(crate) fn set(&mut self, kind: PolicyKind, name: Option<String>) {
        match kind {
            PolicyKind::Router => self.router = name,
            PolicyKind::AdapterSelector => self.adapter_selector = name,
            PolicyKind::DatasetTransform => {}
        }
    }

    pub(crate) fn kinds_of(&self, name: &str) -> Vec<PolicyKind> {
        [PolicyKind::Router, PolicyKind::AdapterSelector]
            .into_iter()
            .filter(|k| self.get(*k).is_some_and(|n| n == name))
            .collect()
    }
}

pub(crate) struct Storage {
    root: PathBuf,
}

fn io(context: &str, path: &Path, e: std::io::Error) -> PolicyError {
    PolicyError::Storage(format!("{context} {}: {e}", path.display()))
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

impl Storage {
    pub(crate) fn open(data_dir: &Path) -> Result<Self, PolicyError> {
        let root = data_dir.join("policies");
        for sub in ["meta", "blobs", "artifacts"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).map_err(|e| io("creating", &dir, e))?;
        }
        Ok(Storage { root })
    }

    fn meta_path(&self, name: &str) -> PathBuf {
        self.root.join("meta").join(format!("{name}.json"))
    }

    fn blob_path(&self, sha: &str) -> PathBuf {
        self.root.join("blobs").join(format!("{sha}.wasm"))
    }

    fn artifact_path(&self, sha: &str, compat: &str) -> PathBuf {
        self.root
            .join("artifacts")
            .join(format!("{sha}-{compat}.cwasm"))
    }

    fn write_atomic(&self, path: &Path, bytes: &[u8]) -> Result<(), PolicyError> {
        let tmp = path.with_extension(format!(
            "{}.tmp{}",
            path.extension().and_then(|e| e.to_str()).unwrap_or(""),
            std::process::id()
        ));
        let mut f = fs::File::create(&tmp).map_err(|e| io("creating", &tmp, e))?;
        f.write_all(bytes).map_err(|e| io("writing", &tmp, e))?;
        f.sync_all().map_err(|e| io("syncing", &tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| io("renaming", path, e))
    }

    pub(crate) fn save_meta(&self, meta: &StoredMeta) -> Result<(), PolicyError> {
        let json = serde_json::to_vec_pretty(meta)
            .map_err(|e| PolicyError::Storage(format!("encoding metadata: {e}")))?;
        self.write_atomic(&self.meta_path(&meta.name), &json)
    }

    pub(crate) fn remove_meta(&self, name: &str) -> Result<(), PolicyError> {
        let path = self.meta_path(name);
        fs::remove_file(&path).map_err(|e| io("removing", &path, e))
    }

    pub(crate) fn save_blob(&self, sha: &str, bytes: &[u8]) -> Result<(), PolicyError> {
        let path = self.blob_path(sha);
        if path.exists() {
            return Ok(());
        }
        self.write_atomic(&path, bytes)
    }

    /// The stored component bytes, checked against their digest.
    pub(crate) fn load_blob(&self, sha: &str) -> Result<Vec<u8>, PolicyError> {
        let path = self.blob_path(sha);
        let bytes = fs::read(&path).map_err(|e| io("reading", &path, e))?;
        if sha256_hex(&bytes) != sha {
            return Err(PolicyError::Storage(format!(
                "{} does not match its digest",
                path.display()
            )));
        }
        Ok(bytes)
    }

    pub(crate) fn save_artifact(
        &self,
        sha: &str,
        compat: &str,
        artifact: &[u8],
    ) -> Result<(), PolicyError> {
        let path = self.artifact_path(sha, compat);
        self.write_atomic(&path, artifact)?;
        let digest = path.with_extension("cwasm.sha256");
        self.write_atomic(&digest, sha256_hex(artifact).as_bytes())
    }

    /// A precompiled artifact that we wrote, verified against the digest we
    /// wrote next to it; `None` when missing or not matching.
    pub(crate) fn load_artifact(&self, sha: &str, compat: &str) -> Option<Vec<u8>> {
        let path = self.artifact_path(sha, compat);
        let expected = fs::read_to_string(path.with_extension("cwasm.sha256")).ok()?;
        let bytes = fs::read(&path).ok()?;
        (sha256_hex(&bytes) == expected.trim()).then_some(bytes)
    }

    /// Deletes the bytes and artifacts of `sha` (no longer referenced).
    pub(crate) fn remove_content(&self, sha: &str) {
        let _ = fs::remove_file(self.blob_path(sha));
        if let Ok(entries) = fs::read_dir(self.root.join("artifacts")) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(sha) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
    }

    /// All stored metadata; unreadable entries are returned as errors.
    pub(crate) fn load_metas(&self) -> Vec<Result<StoredMeta, PolicyError>> {
        let dir = self.root.join("meta");
        let Ok(entries) = fs::read_dir(&dir) else {
            return vec![];
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            out.push(
                fs::read(&path)
                    .map_err(|e| io("reading", &path, e))
                    .and_then(|b| {
                        serde_json::from_slice(&b)
                            .map_err(|e| PolicyError::Storage(format!("{}: {e}", path.display())))
                    }),
            );
        }
        out
    }

    pub(crate) fn load_bindings(&self) -> Bindings {
        fs::read(self.root.join("bindings.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    pub(crate) fn save_bindings(&self, bindings: &Bindings) -> Result<(), PolicyError> {
        let json = serde_json::to_vec_pretty(bindings)
            .map_err(|e| PolicyError::Storage(format!("encoding bindings: {e}")))?;
        self.write_atomic(&self.root.join("bindings.json"), &json)
    }
}
