//! Adapters as the application sees them: where a mount may come from (the
//! configured stores), the mounts made at start, the mounts `finetune` jobs
//! make, and the adapter-selector policy's choice for one request.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::App;
use super::models::{LoadedModel, ModelRegistry};
use super::routing::{RouteError, fail_closed};
use crate::policy::{AdapterInfo as PolicyAdapterInfo, PolicyError, RequestFacts};

/// `path` as an adapter directory inside one of `stores` (a relative path
/// may also name a directory inside a store); anything resolving outside
/// them (`..`, symlinks, absolute paths elsewhere) is refused.
pub fn resolve_in_stores(stores: &[PathBuf], path: &str) -> Result<PathBuf, String> {
    let given = Path::new(path);
    let mut candidates = vec![given.to_owned()];
    if given.is_relative() {
        candidates.extend(stores.iter().map(|s| s.join(given)));
    }
    let roots: Vec<PathBuf> = stores
        .iter()
        .filter_map(|s| s.canonicalize().ok())
        .collect();
    let listed = || {
        stores
            .iter()
            .map(|s| s.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(found) = candidates.iter().find_map(|c| c.canonicalize().ok()) else {
        return Err(format!(
            "adapter directory `{path}` not found (stores: {})",
            listed()
        ));
    };
    if !roots
        .iter()
        .any(|root| found.starts_with(root) && &found != root)
    {
        return Err(format!(
            "adapter directory `{path}` is outside the adapter stores ({}); put it in one or add its folder to [adapters] stores",
            listed()
        ));
    }
    Ok(found)
}

/// The served models' mounts as `finetune` jobs see them (`mount: true`).
struct JobMounts {
    models: Arc<ModelRegistry>,
}

pub fn job_mounts(models: &Arc<ModelRegistry>) -> Arc<dyn crate::jobs::AdapterMounts> {
    Arc::new(JobMounts {
        models: Arc::clone(models),
    })
}

impl crate::jobs::AdapterMounts for JobMounts {
    fn is_mounted(&self, id: &str) -> bool {
        self.models
            .ready()
            .iter()
            .any(|m| m.engine.adapters().iter().any(|a| a.id == id))
    }

    fn mount(
        &self,
        id: &str,
        dir: &Path,
        model: Option<&str>,
        base: &Path,
    ) -> Result<String, String> {
        let target = match model {
            Some(name) => self.models.resolve(name).map_err(|e| e.to_string())?,
            None => {
                let ready = self.models.ready();
                let base = base.canonicalize().ok();
                let same_file = ready
                    .iter()
                    .find(|m| base.is_some() && m.path.canonicalize().ok() == base);
                same_file
                    .or(ready.first())
                    .cloned()
                    .ok_or("no served model is ready to mount it on")?
            }
        };
        target
            .engine
            .mount_adapter(id, dir)
            .map(|_| target.id.clone())
            .map_err(|e| format!("{}: {e}", target.id))
    }
}

/// A configured mount, its path checked against the stores.
#[derive(Debug, Clone)]
pub struct StartupMount {
    pub id: String,
    pub dir: PathBuf,
    pub model: Option<String>,
}

/// `[[adapters.mount]]` entries whose paths lie inside the stores; the
/// others are logged and left out.
pub fn startup_mounts(config: &crate::config::Config) -> Vec<StartupMount> {
    let stores = config.adapter_stores();
    config
        .adapters
        .mount
        .iter()
        .filter_map(|m| match resolve_in_stores(&stores, &m.path) {
            Ok(dir) => Some(StartupMount {
                id: m.id.clone(),
                dir,
                model: m.model.clone(),
            }),
            Err(reason) => {
                tracing::error!(adapter = %m.id, %reason, "configured adapter not mounted");
                None
            }
        })
        .collect()
}

/// Mounts the configured adapters meant for `model` (the `index`-th served
/// one; entries without `model` go on the first). Failures are logged: the
/// model still serves, and the adapter can be mounted later over the API.
pub fn mount_at_start(model: &LoadedModel, index: usize, mounts: &[StartupMount]) {
    let ours = mounts.iter().filter(|m| match &m.model {
        Some(id) => *id == model.id,
        None => index == 0,
    });
    for mount in ours {
        match model.engine.mount_adapter(&mount.id, &mount.dir) {
            Ok(info) => {
                tracing::info!(adapter = %info.id, model = %model.id, modules = info.modules, "adapter mounted")
            }
            Err(error) => {
                tracing::error!(adapter = %mount.id, model = %model.id, %error, "configured adapter not mounted")
            }
        }
    }
}

impl App {
    /// The adapters the bound adapter-selector policy picks for a request
    /// to `model` (none when no selector is bound, or it fails open). The
    /// guest runs on a policy call thread (`policy/pool.rs`), not here.
    /// `facts` are gathered only when a policy host exists.
    pub async fn select_adapters<'a>(
        &self,
        model: &LoadedModel,
        facts: impl FnOnce() -> RequestFacts<'a>,
    ) -> Result<Vec<String>, RouteError> {
        let host = match self.policy_host().await {
            Ok(Some(host)) => host,
            _ => return Ok(Vec::new()),
        };
        let infos: Vec<PolicyAdapterInfo> = model
            .engine
            .adapters()
            .iter()
            .map(|a| PolicyAdapterInfo {
                id: a.id.clone(),
                rank: a.rank as u32,
                scale: a.scale,
                // Policies see the model the adapter is mounted on.
                base_model: model.id.clone(),
            })
            .collect();
        match host.select_if_bound(&facts(), infos).await {
            Ok(choice) => Ok(choice.unwrap_or_default()),
            Err(e) if e.is_fail_open() => {
                if !matches!(e, PolicyError::NotBound(_)) {
                    tracing::warn!(error = %e, "adapter selector failed; fail_open: base model");
                }
                Ok(Vec::new())
            }
            Err(e) => Err(fail_closed(&e, "adapter selection")),
        }
    }
}
