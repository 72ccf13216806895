//! `/v1/adapters`: the mounted LoRA adapters (listing is open to `infer`
//! keys; mounting and unmounting need `admin`), `/v1/adapters/available`
//! (adapter directories in the configured stores), and the choice of
//! adapters for one request.
//!
//! Answers show an adapter's directory as `store` (its index in
//! `[adapters] stores`) and `path`: absolute for admin keys, relative to the
//! store for everyone else (the form `POST /v1/adapters` takes), so
//! inference keys do not learn the server's directory layout.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use http::{Method, Request, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::body::{self, ReqBody};
use super::models::{LoadedModel, ModelRegistry};
use super::openai::HandlerResult;
use super::openai::validate::Common;
use super::routing::{self, Local};
use super::{ApiError, Caller, Ctx, Route, Scope};
use crate::engine::lora::{self, AdapterInfo};
use crate::policy::AdapterInfo as PolicyAdapterInfo;

pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::GET, "/v1/adapters", |cx, req| {
            Box::pin(list(cx, req))
        }),
        Route::new(Method::POST, "/v1/adapters", |cx, req| {
            Box::pin(mount(cx, req))
        }),
        Route::new(Method::GET, "/v1/adapters/available", |cx, req| {
            Box::pin(available(cx, req))
        }),
        Route::new(Method::DELETE, "/v1/adapters/{id}", |cx, req| {
            Box::pin(unmount(cx, req))
        }),
    ]
}

/// How adapter directories are shown to one caller (see the module doc).
struct PathView {
    admin: bool,
    /// The stores, canonicalized, in config order (`None`: missing).
    roots: Vec<Option<PathBuf>>,
}

impl PathView {
    fn new(cx: &Ctx, req: &Request<ReqBody>) -> PathView {
        let admin = req
            .extensions()
            .get::<Caller>()
            .is_some_and(|c| c.has(Scope::Admin));
        let roots = cx
            .state
            .config
            .adapter_stores()
            .iter()
            .map(|s| s.canonicalize().ok())
            .collect();
        PathView { admin, roots }
    }

    /// `(store, path)` for an adapter directory: the index of the store
    /// holding it, and its path (relative unless the caller is an admin).
    /// A directory outside every store shows `null` for both to non-admins.
    fn show(&self, dir: &Path) -> (Value, Value) {
        let canonical = dir.canonicalize().ok();
        let found = self.roots.iter().enumerate().find_map(|(i, root)| {
            let root = root.as_deref()?;
            [Some(dir), canonical.as_deref()]
                .into_iter()
                .flatten()
                .find_map(|d| d.strip_prefix(root).ok())
                .map(|rel| (i, rel))
        });
        match (found, self.admin) {
            (Some((i, _)), true) => (json!(i), json!(dir.to_string_lossy())),
            (Some((i, rel)), false) => (json!(i), json!(rel.to_string_lossy())),
            (None, true) => (Value::Null, json!(dir.to_string_lossy())),
            (None, false) => (Value::Null, Value::Null),
        }
    }
}

fn object(model: &str, info: &AdapterInfo, view: &PathView) -> Value {
    let (store, path) = view.show(&info.path);
    json!({
        "object": "adapter",
        "id": info.id,
        "model": model,
        "store": store,
        "path": path,
        "format": info.format,
        "rank": info.rank,
        "scale": info.scale,
        "base_model": info.base_model,
        "modules": info.modules,
        "skipped_tensors": info.skipped_tensors,
        "size_bytes": info.size_bytes,
    })
}

async fn list(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let view = PathView::new(&cx, &req);
    let data: Vec<Value> = cx
        .state
        .models
        .ready()
        .iter()
        .flat_map(|m| {
            m.engine
                .adapters()
                .into_iter()
                .map(|a| object(&m.id, &a, &view))
                .collect::<Vec<_>>()
        })
        .collect();
    body::json(StatusCode::OK, &json!({"object": "list", "data": data}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MountBody {
    id: String,
    path: String,
    /// The base model to mount on; default: the first served model.
    model: Option<String>,
}

fn bad(param: &str, message: String, code: &'static str) -> ApiError {
    ApiError::InvalidParam {
        message,
        param: param.into(),
        code,
    }
}

/// The model a mount or unmount acts on.
fn target_model(cx: &Ctx, requested: Option<&str>) -> Result<LoadedModel, ApiError> {
    match requested {
        Some(id) => cx.state.models.resolve(id),
        None => cx.state.models.ready().into_iter().next().ok_or_else(|| {
            ApiError::NotReady(
                "no model is ready yet; GET /readyz answers 200 once they are".into(),
            )
        }),
    }
}

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

async fn mount(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    cx.state
        .keys
        .require(req.extensions().get::<Caller>(), Scope::Admin)?;
    let view = PathView::new(&cx, &req);
    let b: MountBody = body::read_json(req).await?;
    lora::validate_id(&b.id).map_err(|e| bad("id", e.to_string(), "invalid_value"))?;
    let dir = resolve_in_stores(&cx.state.config.adapter_stores(), &b.path)
        .map_err(|e| bad("path", e, "invalid_value"))?;
    let model = target_model(&cx, b.model.as_deref())?;
    let engine = model.engine.clone();
    let id = b.id.clone();
    let started = Instant::now();
    let info = tokio::task::spawn_blocking(move || engine.mount_adapter(&id, &dir))
        .await
        .map_err(|e| ApiError::Internal(format!("mounting failed: {e}")))?
        .map_err(|e| bad("path", e.to_string(), "invalid_adapter"))?;
    let mut answer = object(&model.id, &info, &view);
    answer["mount_ms"] = json!(started.elapsed().as_secs_f64() * 1e3);
    body::json(StatusCode::CREATED, &answer)
}

async fn unmount(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    cx.state
        .keys
        .require(req.extensions().get::<Caller>(), Scope::Admin)?;
    let id = cx.param("id").unwrap_or_default().to_owned();
    let models = cx.state.models.ready();
    let removed = tokio::task::spawn_blocking({
        let id = id.clone();
        move || {
            let mut removed = false;
            for m in &models {
                removed |= m.engine.unmount_adapter(&id).unwrap_or(false);
            }
            removed
        }
    })
    .await
    .map_err(|e| ApiError::Internal(format!("unmounting failed: {e}")))?;
    if !removed {
        return Err(ApiError::NotFound {
            message: format!("No adapter `{id}` is mounted; GET /v1/adapters lists them."),
            code: "adapter_not_found",
        });
    }
    body::json(
        StatusCode::OK,
        &json!({"object": "adapter.deleted", "id": id, "deleted": true}),
    )
}

/// Adapter directories in the stores (one level deep), with their configs.
async fn available(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let view = PathView::new(&cx, &req);
    let stores = cx.state.config.adapter_stores();
    let mounted: Vec<PathBuf> = cx
        .state
        .models
        .ready()
        .iter()
        .flat_map(|m| m.engine.adapters().into_iter().map(|a| a.path))
        .collect();
    let data = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for store in &stores {
            let Ok(entries) = std::fs::read_dir(store) else {
                continue;
            };
            let mut dirs: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect();
            dirs.sort();
            for dir in dirs {
                let Ok(config) = lora::read_config(&dir) else {
                    continue;
                };
                let id = dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let canonical = dir.canonicalize().unwrap_or_else(|_| dir.clone());
                let (store, path) = view.show(&canonical);
                out.push(json!({
                    "object": "adapter.available",
                    "id": id,
                    "store": store,
                    "path": path,
                    "format": config.format,
                    "rank": config.rank,
                    "scale": config.scale,
                    "base_model": config.base_model,
                    "mounted": mounted.contains(&canonical),
                }));
            }
        }
        out
    })
    .await
    .map_err(|e| ApiError::Internal(format!("scanning adapter stores failed: {e}")))?;
    body::json(StatusCode::OK, &json!({"object": "list", "data": data}))
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

/// The adapters `request` runs with: the body's `adapter`, else the
/// `X-Adapter` header, else the bound adapter-selector policy's choice
/// (none when no selector is bound or it fails open). Ids are checked
/// against the mounted ones by the engine.
pub async fn for_request(
    cx: &Ctx,
    local: &Local,
    common: &Common,
    model: &LoadedModel,
) -> Result<Vec<String>, ApiError> {
    if let Some(ids) = &common.adapter {
        return Ok(ids.clone());
    }
    if let Some(header) = local.head.headers.get("x-adapter") {
        let spec = header.to_str().map_err(|_| {
            bad(
                "X-Adapter",
                "the X-Adapter header is not ASCII".into(),
                "invalid_value",
            )
        })?;
        return lora::parse_spec(spec).map_err(|e| {
            bad(
                "X-Adapter",
                format!("Invalid X-Adapter header: {e}."),
                "invalid_value",
            )
        });
    }
    let mounted = model.engine.adapters();
    let host = match routing::policy_host(&cx.state).await {
        Ok(Some(host)) => host,
        _ => return Ok(Vec::new()),
    };
    let infos: Vec<PolicyAdapterInfo> = mounted
        .iter()
        .map(|a| PolicyAdapterInfo {
            id: a.id.clone(),
            rank: a.rank as u32,
            scale: a.scale,
            // Policies see the model the adapter is mounted on.
            base_model: model.id.clone(),
        })
        .collect();
    let facts = routing::request_facts(
        &local.head.method,
        local.head.uri.path(),
        &local.head.headers,
        local.head.extensions.get::<Caller>(),
        &model.id,
        0,
        common
            .max_tokens
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        common.stream,
    );
    // Off the async worker: a call thread runs the guest (`policy/pool.rs`).
    match host.select_if_bound(&facts, infos).await {
        Ok(choice) => Ok(choice.unwrap_or_default()),
        Err(e) if e.is_fail_open() => {
            if !matches!(e, crate::policy::PolicyError::NotBound(_)) {
                tracing::warn!(error = %e, "adapter selector failed; fail_open: base model");
            }
            Ok(Vec::new())
        }
        Err(e) => Err(routing::fail_closed(&e, "adapter selection")),
    }
}
