//! The `[jobs]` config section and the folders path inputs may use.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use super::types::JobKind;

/// `[jobs]` in the config file:
///
/// ```toml
/// [jobs]
/// enable_crash = false                     # the crash kind, for tests and drills
/// allowed_paths = ["/srv/datasets", "models"]  # default: <data_dir>/files
/// concurrency = { quantize = 1, dataset = 2 }  # default: noop/crash 4, others 1
/// ```
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobsConfig {
    pub enable_crash: bool,
    /// Folders that dataset/quantize inputs and outputs must lie under.
    /// Relative entries are relative to the working directory.
    pub allowed_paths: Vec<PathBuf>,
    /// Jobs of a kind that may run at once; the rest wait `queued`.
    pub concurrency: BTreeMap<JobKind, NonZeroUsize>,
    /// Largest file `PUT /api/files/{name}` takes (default 64 GiB).
    pub max_upload_bytes: Option<u64>,
}

/// [`JobsConfig::max_upload_bytes`] when unset.
pub const DEFAULT_MAX_UPLOAD_BYTES: u64 = 64 << 30;

impl JobsConfig {
    pub fn max_upload_bytes(&self) -> u64 {
        self.max_upload_bytes.unwrap_or(DEFAULT_MAX_UPLOAD_BYTES)
    }

    /// Where uploaded files go (`PUT /api/files/{name}`): the first allowed
    /// path, by default `<data_dir>/files`, so jobs can read them.
    pub fn file_store(&self, data_dir: &Path) -> PathBuf {
        self.allowed_paths
            .first()
            .cloned()
            .unwrap_or_else(|| data_dir.join("files"))
    }

    pub fn concurrency_of(&self, kind: JobKind) -> usize {
        self.concurrency.get(&kind).map_or(
            match kind {
                JobKind::Noop | JobKind::Crash => 4,
                _ => 1,
            },
            |n| n.get(),
        )
    }
}

/// Why a path was refused; the caller names the field.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("`{0}` does not exist")]
    Missing(String),
    #[error("`{0}` is outside the folders jobs may use ([jobs] allowed_paths)")]
    Outside(String),
    #[error("`{0}` must not contain `..`")]
    DotDot(String),
    #[error("`{0}` is empty")]
    Empty(String),
}

/// The canonical folders path inputs must lie under.
#[derive(Debug, Clone)]
pub struct PathGuard {
    roots: Vec<PathBuf>,
}

impl PathGuard {
    /// `roots` that do not exist are created (they are the operator's
    /// choice); ones that still cannot be resolved are skipped.
    pub fn new(roots: &[PathBuf]) -> PathGuard {
        let roots = roots
            .iter()
            .filter_map(|r| {
                let _ = std::fs::create_dir_all(r);
                std::fs::canonicalize(r).ok()
            })
            .collect();
        PathGuard { roots }
    }

    fn check_under(&self, raw: &str, canonical: PathBuf) -> Result<PathBuf, PathError> {
        if self.roots.iter().any(|r| canonical.starts_with(r)) {
            Ok(canonical)
        } else {
            Err(PathError::Outside(raw.to_owned()))
        }
    }

    /// An existing file or folder, resolved through symlinks.
    pub fn existing(&self, raw: &str) -> Result<PathBuf, PathError> {
        if raw.trim().is_empty() {
            return Err(PathError::Empty(raw.to_owned()));
        }
        let p = Path::new(raw);
        if p.components().any(|c| c == Component::ParentDir) {
            return Err(PathError::DotDot(raw.to_owned()));
        }
        let canonical = std::fs::canonicalize(p).map_err(|_| PathError::Missing(raw.to_owned()))?;
        self.check_under(raw, canonical)
    }

    /// A path to be written, which may not exist yet: its deepest existing
    /// ancestor is resolved through symlinks and the rest appended.
    pub fn writable(&self, raw: &str) -> Result<PathBuf, PathError> {
        if raw.trim().is_empty() {
            return Err(PathError::Empty(raw.to_owned()));
        }
        let p = Path::new(raw);
        if p.components().any(|c| c == Component::ParentDir) {
            return Err(PathError::DotDot(raw.to_owned()));
        }
        let p = if p.is_absolute() {
            p.to_owned()
        } else {
            std::env::current_dir()
                .map_err(|_| PathError::Missing(raw.to_owned()))?
                .join(p)
        };
        let mut base = p.as_path();
        let mut rest = Vec::new();
        let canonical_base = loop {
            match std::fs::canonicalize(base) {
                Ok(c) => break c,
                Err(_) => {
                    rest.push(
                        base.file_name()
                            .ok_or_else(|| PathError::Missing(raw.to_owned()))?,
                    );
                    base = base
                        .parent()
                        .ok_or_else(|| PathError::Missing(raw.to_owned()))?;
                }
            }
        };
        let full = rest.iter().rev().fold(canonical_base, |acc, c| acc.join(c));
        self.check_under(raw, full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_under_the_roots() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("in")).unwrap();
        std::fs::write(root.join("in/a.jsonl"), "").unwrap();
        let g = PathGuard::new(std::slice::from_ref(&root));
        let s = |p: &Path| p.display().to_string();
        assert!(g.existing(&s(&root.join("in/a.jsonl"))).is_ok());
        assert_eq!(
            g.existing(&s(&root.join("in/../in/a.jsonl"))),
            Err(PathError::DotDot(s(&root.join("in/../in/a.jsonl"))))
        );
        assert!(matches!(
            g.existing(&s(&root.join("nope"))),
            Err(PathError::Missing(_))
        ));
        assert!(matches!(
            g.existing("/etc/hostname"),
            Err(PathError::Outside(_)) | Err(PathError::Missing(_))
        ));
        assert!(g.writable(&s(&root.join("out/deeper"))).is_ok());
        assert!(matches!(
            g.writable(&s(&dir.path().join("x"))),
            Err(PathError::Outside(_))
        ));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(dir.path(), root.join("escape")).unwrap();
            assert!(matches!(
                g.writable(&s(&root.join("escape/out"))),
                Err(PathError::Outside(_))
            ));
        }
    }

    #[test]
    fn parses_the_section() {
        let c: JobsConfig =
            toml::from_str("enable_crash = true\nconcurrency = { quantize = 2 }").unwrap();
        assert!(c.enable_crash);
        assert_eq!(c.concurrency_of(JobKind::Quantize), 2);
        assert_eq!(c.concurrency_of(JobKind::Noop), 4);
        assert!(toml::from_str::<JobsConfig>("concurrency = { quantize = 0 }").is_err());
        assert!(toml::from_str::<JobsConfig>("concurrency = { nope = 1 }").is_err());
        assert!(toml::from_str::<JobsConfig>("enable_krash = true").is_err());
    }
}
