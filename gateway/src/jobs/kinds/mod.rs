//! The job kinds: each parses and checks its config at submit time (so a bad
//! config is a 400 naming the field, never a failed job) and then runs on a
//! blocking thread, reporting through a [`JobCtx`].

pub mod crash;
pub mod dataset;
pub mod finetune;
pub mod noop;
pub mod quantize;

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::config::{PathError, PathGuard};
use super::runner::{JobCtx, RunError};
use super::types::JobKind;
use crate::policy::PolicyHost;

/// A submitted config that cannot run; `param` names the field, e.g.
/// `kind` or `config.steps`.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{message}")]
pub struct ConfigError {
    pub param: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            param: param.into(),
            message: message.into(),
        }
    }
}

/// Opens the process's policy host on demand (wired by the server).
pub type PolicyProvider = Arc<dyn Fn() -> Result<Arc<PolicyHost>, String> + Send + Sync>;

/// The served models' LoRA mounts, as `finetune`'s `mount` needs them
/// (wired by the server, which owns the engines; the jobs module knows no
/// HTTP and no model registry).
pub trait AdapterMounts: Send + Sync {
    /// Whether an adapter `id` is mounted on any served model.
    fn is_mounted(&self, id: &str) -> bool;
    /// Mounts the adapter in `dir` as `id` on the served model `model`, or
    /// by default on the one loaded from `base` (the model trained on), else
    /// the first served one; returns that model's id. Blocking.
    fn mount(
        &self,
        id: &str,
        dir: &Path,
        model: Option<&str>,
        base: &Path,
    ) -> Result<String, String>;
}

/// What config checking may consult.
pub struct Env<'a> {
    pub enable_crash: bool,
    pub paths: &'a PathGuard,
    pub policies: Option<&'a PolicyProvider>,
    /// `[adapters] stores`, canonical, in config order: `finetune` writes to
    /// the first when no `output_dir` is given.
    pub adapter_stores: &'a [PathBuf],
    pub adapters: Option<&'a Arc<dyn AdapterMounts>>,
}

/// How a job that ran to the end reports back.
#[derive(Debug, Default)]
pub struct Outcome {
    pub output_path: Option<PathBuf>,
    pub summary: Option<Value>,
}

/// A checked, ready-to-run job.
pub enum Spec {
    Noop(noop::NoopSpec),
    Crash(crash::CrashSpec),
    Dataset(dataset::DatasetSpec),
    Quantize(quantize::QuantizeSpec),
    Finetune(Box<finetune::FinetuneSpec>),
}

impl Spec {
    pub fn parse(kind: JobKind, config: &Value, env: &Env<'_>) -> Result<Spec, ConfigError> {
        let fields = Fields::new(config)?;
        Ok(match kind {
            JobKind::Noop => Spec::Noop(noop::NoopSpec::parse(fields)?),
            JobKind::Crash => {
                if !env.enable_crash {
                    return Err(ConfigError::new(
                        "kind",
                        "crash jobs are disabled; set enable_crash = true under [jobs] in the config",
                    ));
                }
                Spec::Crash(crash::CrashSpec::parse(fields)?)
            }
            JobKind::Dataset => {
                Spec::Dataset(dataset::DatasetSpec::parse(fields, env)?.with_config(config))
            }
            JobKind::Quantize => Spec::Quantize(quantize::QuantizeSpec::parse(fields, env)?),
            JobKind::Finetune => {
                Spec::Finetune(Box::new(finetune::FinetuneSpec::parse(fields, env)?))
            }
        })
    }

    pub fn run(self, ctx: &JobCtx) -> Result<Outcome, RunError> {
        match self {
            Spec::Noop(s) => s.run(ctx),
            Spec::Crash(s) => s.run(ctx),
            Spec::Dataset(s) => s.run(ctx),
            Spec::Quantize(s) => s.run(ctx),
            Spec::Finetune(s) => s.run(ctx),
        }
    }
}

/// Reads a config object field by field, so each error names its field and
/// unknown fields are refused (a typo must not silently keep a default).
pub struct Fields {
    map: Map<String, Value>,
}

fn param(key: &str) -> String {
    format!("config.{key}")
}

impl Fields {
    pub fn new(config: &Value) -> Result<Fields, ConfigError> {
        match config {
            Value::Null => Ok(Fields { map: Map::new() }),
            Value::Object(m) => Ok(Fields { map: m.clone() }),
            _ => Err(ConfigError::new("config", "config must be a JSON object")),
        }
    }

    pub fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key).filter(|v| !v.is_null())
    }

    pub fn u64(
        &mut self,
        key: &str,
        default: Option<u64>,
        range: RangeInclusive<u64>,
    ) -> Result<u64, ConfigError> {
        let v = match self.take(key) {
            None => default
                .ok_or_else(|| ConfigError::new(param(key), format!("`{key}` is required")))?,
            Some(v) => v.as_u64().ok_or_else(|| {
                ConfigError::new(
                    param(key),
                    format!("`{key}` must be a non-negative integer"),
                )
            })?,
        };
        if !range.contains(&v) {
            return Err(ConfigError::new(
                param(key),
                format!("`{key}` must be in {}..={}", range.start(), range.end()),
            ));
        }
        Ok(v)
    }

    pub fn f64(
        &mut self,
        key: &str,
        default: f64,
        range: RangeInclusive<f64>,
    ) -> Result<f64, ConfigError> {
        let v = match self.take(key) {
            None => default,
            Some(v) => v
                .as_f64()
                .ok_or_else(|| ConfigError::new(param(key), format!("`{key}` must be a number")))?,
        };
        if !range.contains(&v) {
            return Err(ConfigError::new(
                param(key),
                format!("`{key}` must be in {}..={}", range.start(), range.end()),
            ));
        }
        Ok(v)
    }

    pub fn opt_string(&mut self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ConfigError::new(
                param(key),
                format!("`{key}` must be a string"),
            )),
        }
    }

    /// One of `options` by name (the first when absent); anything else is
    /// an error listing them.
    pub fn choice<T: Copy>(&mut self, key: &str, options: &[(&str, T)]) -> Result<T, ConfigError> {
        let Some(given) = self.opt_string(key)? else {
            return Ok(options[0].1);
        };
        options
            .iter()
            .find(|(name, _)| *name == given)
            .map(|(_, v)| *v)
            .ok_or_else(|| {
                let names: Vec<String> = options.iter().map(|(n, _)| format!("\"{n}\"")).collect();
                ConfigError::new(
                    param(key),
                    format!("`{key}` must be {}, not \"{given}\"", names.join(" or ")),
                )
            })
    }

    pub fn string(&mut self, key: &str) -> Result<String, ConfigError> {
        self.opt_string(key)?
            .ok_or_else(|| ConfigError::new(param(key), format!("`{key}` is required")))
    }

    pub fn bool(&mut self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.take(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(b),
            Some(_) => Err(ConfigError::new(
                param(key),
                format!("`{key}` must be true or false"),
            )),
        }
    }

    /// An existing input path under the allowed folders.
    pub fn input_path(&mut self, key: &str, guard: &PathGuard) -> Result<PathBuf, ConfigError> {
        let raw = self.string(key)?;
        guard.existing(&raw).map_err(|e| path_error(key, e))
    }

    /// An output path under the allowed folders (may not exist yet).
    pub fn output_path(&mut self, key: &str, guard: &PathGuard) -> Result<PathBuf, ConfigError> {
        let raw = self.string(key)?;
        guard.writable(&raw).map_err(|e| path_error(key, e))
    }

    /// [`Fields::output_path`] for an optional field.
    pub fn opt_output_path(
        &mut self,
        key: &str,
        guard: &PathGuard,
    ) -> Result<Option<PathBuf>, ConfigError> {
        match self.opt_string(key)? {
            None => Ok(None),
            Some(raw) => guard
                .writable(&raw)
                .map(Some)
                .map_err(|e| path_error(key, e)),
        }
    }

    /// Refuses fields nobody read.
    pub fn finish(self) -> Result<(), ConfigError> {
        match self.map.keys().next() {
            Some(k) => Err(ConfigError::new(
                param(k),
                format!("unknown config field `{k}`"),
            )),
            None => Ok(()),
        }
    }
}

fn path_error(key: &str, e: PathError) -> ConfigError {
    ConfigError::new(param(key), format!("`{key}`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_name_the_offending_param() {
        let mut f = Fields::new(&json!({"steps": -1, "x": 1})).unwrap();
        assert_eq!(
            f.u64("steps", Some(1), 0..=5).unwrap_err().param,
            "config.steps"
        );
        assert_eq!(f.finish().unwrap_err().param, "config.x");
        let mut f = Fields::new(&json!({"steps": 9})).unwrap();
        assert!(f.u64("steps", None, 0..=5).is_err());
        assert!(Fields::new(&json!([1])).is_err());
    }
}
