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
use std::time::Instant;

use http::{Method, Request, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::body::{self, ReqBody};
use super::openai::HandlerResult;
use super::openai::validate::Common;
use super::routing::{self, Local};
use super::{ApiError, Caller, Ctx, Route, Scope};
use crate::app::LoadedModel;
use crate::app::adapters::resolve_in_stores;
use crate::engine::lora::{self, AdapterInfo};

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
            .app
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
        .app
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
        Some(id) => Ok(cx.state.app.models.resolve(id)?),
        None => cx
            .state
            .app
            .models
            .ready()
            .into_iter()
            .next()
            .ok_or_else(|| {
                ApiError::NotReady(
                    "no model is ready yet; GET /readyz answers 200 once they are".into(),
                )
            }),
    }
}

async fn mount(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    cx.state
        .keys
        .require(req.extensions().get::<Caller>(), Scope::Admin)?;
    let view = PathView::new(&cx, &req);
    let b: MountBody = body::read_json(req).await?;
    lora::validate_id(&b.id).map_err(|e| bad("id", e.to_string(), "invalid_value"))?;
    let dir = resolve_in_stores(&cx.state.app.config.adapter_stores(), &b.path)
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
    let models = cx.state.app.models.ready();
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
    let stores = cx.state.app.config.adapter_stores();
    let mounted: Vec<PathBuf> = cx
        .state
        .app
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

/// The adapters `request` runs with: the body's `adapter`, else the
/// `X-Adapter` header, else the bound adapter-selector policy's choice
/// (none when no selector is bound or it fails open). Ids are checked
/// against the mounted ones by the engine.
pub async fn for_request(
    cx: &Ctx,
    local: &Local,
    common: &Common,
    model: &LoadedModel,
    prompt_tokens: usize,
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
    let facts = || {
        routing::request_facts(
            &local.head.method,
            local.head.uri.path(),
            &local.head.headers,
            local.head.extensions.get::<Caller>(),
            &model.id,
            u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            common
                .max_tokens
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
            common.stream,
            &common.features,
        )
    };
    Ok(cx.state.app.select_adapters(model, facts).await?)
}
