//! `/v1/prompt_caches`: save a prompt's keys and values under a name, list,
//! inspect and delete them. Requests use one with `"prompt_cache": "<name>"`.
//! (The automatic mode needs no API: see `[prompt_cache]` in the config.)
//!
//! A cache belongs to the tenant of the key that saved it. Other tenants do
//! not see it: listing leaves it out, and getting, deleting or using it
//! answers as for a name that does not exist. Saving over it is refused with
//! 409 (in one namespace of names, a taken name cannot be hidden). Callers
//! with the `admin` scope see, use, replace and delete every cache, and they
//! alone reach files without an owner (written before caches had owners).
//! With no API keys configured there are no tenants: everyone is the
//! operator.

use http::{Method, Request, StatusCode};
use serde_json::{Value, json};

use super::auth::{Caller, Scope};
use super::body::{self, ReqBody};
use super::openai::validate::{self, CacheContent};
use super::openai::{HandlerResult, engine::prompt_cache::CacheInfo};
use super::{ApiError, Ctx, Route};
use crate::engine::Prompt;
use crate::engine::prompt_cache::{CacheScope, CacheStore};

pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::GET, "/v1/prompt_caches", |cx, req| {
            Box::pin(list(cx, req))
        }),
        Route::new(Method::POST, "/v1/prompt_caches", |cx, req| {
            Box::pin(create(cx, req))
        }),
        Route::new(Method::GET, "/v1/prompt_caches/{name}", |cx, req| {
            Box::pin(get(cx, req))
        }),
        Route::new(Method::DELETE, "/v1/prompt_caches/{name}", |cx, req| {
            Box::pin(delete(cx, req))
        }),
    ]
}

fn store(cx: &Ctx) -> Result<std::sync::Arc<CacheStore>, ApiError> {
    cx.state.app.prompt_caches.clone().ok_or_else(|| {
        ApiError::Internal(format!(
            "prompt cache files are unavailable: the directory {} could not be opened (see the server log)",
            cx.state.app.config.prompt_cache_dir().display()
        ))
    })
}

/// The prompt-cache scope of a request by `caller`: its tenant, sharing as
/// the config says, every named cache for admin-scope callers. Without any
/// configured key there are no tenants to keep apart, so the (loopback-only)
/// anonymous caller is the operator.
pub fn scope(cx: &Ctx, caller: Option<&Caller>) -> CacheScope {
    let share = cx.state.app.config.prompt_cache.share_across_tenants;
    if cx.state.keys.is_empty() {
        return CacheScope {
            share,
            ..CacheScope::operator()
        };
    }
    match caller {
        Some(c) => CacheScope::tenant(&c.tenant, share, c.has(Scope::Admin)),
        // The dispatcher attaches a caller to every /v1 request; without one,
        // no admin rights and no sharing: only what the empty tenant made.
        None => CacheScope::tenant("", false, false),
    }
}

fn caller_scope(cx: &Ctx, req: &Request<ReqBody>) -> CacheScope {
    scope(cx, req.extensions().get::<Caller>())
}

fn object(info: &CacheInfo) -> Value {
    json!({
        "object": "prompt_cache",
        "name": info.name,
        "owner": info.owner,
        "model": info.model,
        "adapters": info.adapters,
        "tokens": info.tokens,
        "bytes": info.bytes,
        "created": info.created,
        "auto": info.auto,
    })
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound {
        message: format!(
            "There is no prompt cache named `{name}`; GET /v1/prompt_caches lists them."
        ),
        code: "prompt_cache_not_found",
    }
}

async fn list(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let scope = caller_scope(&cx, &req);
    let data: Vec<Value> = store(&cx)?.list_for(&scope).iter().map(object).collect();
    body::json(StatusCode::OK, &json!({"object": "list", "data": data}))
}

async fn get(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let scope = caller_scope(&cx, &req);
    let name = cx.param("name").unwrap_or_default();
    let info = store(&cx)?
        .get_for(name, &scope)
        .ok_or_else(|| not_found(name))?;
    body::json(StatusCode::OK, &object(&info))
}

async fn delete(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let scope = caller_scope(&cx, &req);
    let name = cx.param("name").unwrap_or_default().to_owned();
    let store = store(&cx)?;
    let removed = tokio::task::spawn_blocking({
        let name = name.clone();
        move || store.delete_for(&name, &scope)
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::Internal(format!("cannot delete prompt cache `{name}`: {e}")))?;
    if !removed {
        return Err(not_found(&name));
    }
    body::json(
        StatusCode::OK,
        &json!({"object": "prompt_cache.deleted", "name": name, "deleted": true}),
    )
}

/// Prefills the prompt (reusing what the caller's tenant cached) and writes
/// the file as the tenant's.
async fn create(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let scope = caller_scope(&cx, &req);
    let json: Value = body::read_json(req).await?;
    let request = validate::save_cache_request(&json)?;
    store(&cx)?;
    let model = cx.state.app.models.resolve(&request.model)?;
    let engine = model.engine.clone();
    let param = match request.content {
        CacheContent::Prompt(_) => "prompt",
        CacheContent::Messages(_) => "messages",
    };
    let info = tokio::task::spawn_blocking(move || {
        let prompt = match request.content {
            CacheContent::Prompt(prompt) => prompt,
            CacheContent::Messages(messages) => {
                Prompt::Tokens(engine.chat_prefix_tokens(&messages)?)
            }
        };
        let tokens = engine.prompt_tokens(prompt)?;
        engine.save_named_prompt_cache(&request.name, &scope, tokens)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("saving the prompt cache failed: {e}")))?
    .map_err(|e| ApiError::from_engine(e, param))?
    .map_err(|e| ApiError::from_save(e, param))?;
    body::json(StatusCode::CREATED, &object(&info))
}

/// Prometheus text for every ready model's prompt-cache counters and the
/// store's files.
pub fn render_metrics(state: &super::AppState) -> String {
    use std::fmt::Write;
    let models = state.app.models.ready();
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, u64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in rows {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    };
    let stats: Vec<(String, _)> = models
        .iter()
        .map(|m| {
            let model = format!("model=\"{}\"", crate::util::prometheus_label(&m.id));
            (model, m.engine.prompt_cache_stats())
        })
        .collect();
    let per_model = |f: fn(&crate::engine::prompt_cache::CacheStatsSnapshot) -> u64| {
        stats
            .iter()
            .map(|(l, s)| (l.clone(), f(s)))
            .collect::<Vec<_>>()
    };
    let mut lookups = Vec::new();
    for (labels, s) in &stats {
        for (result, n) in [
            ("memory_hit", s.memory_hits),
            ("disk_hit", s.disk_hits),
            ("miss", s.misses),
        ] {
            lookups.push((format!("{labels},result=\"{result}\""), n));
        }
    }
    family(
        "mlxgate_prompt_cache_lookups_total",
        "counter",
        "Prompts looked up in the prompt caches, by outcome.",
        lookups,
    );
    family(
        "mlxgate_prompt_cache_reused_tokens_total",
        "counter",
        "Prompt tokens served from a cache instead of prefilled.",
        per_model(|s| s.reused_tokens),
    );
    family(
        "mlxgate_prompt_cache_memory_bytes",
        "gauge",
        "Bytes of keys and values held by the in-memory prompt cache.",
        per_model(|s| s.memory_bytes),
    );
    family(
        "mlxgate_prompt_cache_memory_entries",
        "gauge",
        "Sequences held by the in-memory prompt cache.",
        per_model(|s| s.memory_entries),
    );
    family(
        "mlxgate_prompt_cache_auto_saves_total",
        "counter",
        "Prompt cache files written by the automatic mode.",
        per_model(|s| s.auto_saves),
    );
    if let Some(store) = &state.app.prompt_caches {
        let files = store.list();
        family(
            "mlxgate_prompt_cache_files",
            "gauge",
            "Prompt cache files on disk.",
            vec![(String::new(), files.len() as u64)],
        );
        family(
            "mlxgate_prompt_cache_file_bytes",
            "gauge",
            "Bytes of prompt cache files on disk.",
            vec![(String::new(), files.iter().map(|f| f.bytes).sum())],
        );
    }
    out
}
