//! Admin API for Wasm policies (all under `/admin/`, so the dispatcher
//! requires the `admin` scope):
//!
//! - `PUT /admin/policies/{name}?kind=router&on_error=fail_open&config=...`
//!   with the component bytes as body. Optional limits: `deadline_ms`, `fuel`,
//!   `memory_mb`, `warm_instances`, `max_output_bytes` (unset ones take the
//!   kind's defaults). 201 for a new name, 200 for a new version; both return
//!   the policy's info.
//! - `GET /admin/policies`, `GET /admin/policies/{name}` (info + metrics).
//! - `DELETE /admin/policies/{name}` (409 while bound).
//! - `PUT /admin/bindings/{router|adapter-selector}` with `{"policy": "name"}`
//!   (or `{"policy": null}` to unbind).
//!
//! The server's one [`PolicyHost`] ([`crate::app::Policies`]), opened on
//! first use. Errors keep the OpenAI error shape; `code` is the
//! [`PolicyError::code`].

use std::collections::HashMap;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::json;

use super::body::{self, Body, ReqBody};
use super::{ApiError, AppState, Ctx, Route};
use crate::policy::{
    Limits, OnError, PolicyError, PolicyHost, PolicyKind, PolicyOptions, render_prometheus,
};

type HandlerResult = Result<Response<Body>, ApiError>;

/// Largest component accepted over HTTP (the host's own ceiling is the same).
pub const MAX_UPLOAD_BYTES: u64 = 64 << 20;

/// The admin routes; `http::routes()` extends its table with these.
pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::PUT, "/admin/bindings/{kind}", |cx, req| {
            Box::pin(put_binding(cx, req))
        }),
        Route::new(Method::GET, "/admin/policies", |cx, req| {
            Box::pin(list(cx, req))
        }),
        Route::new(Method::DELETE, "/admin/policies/{name}", |cx, req| {
            Box::pin(delete(cx, req))
        }),
        Route::new(Method::GET, "/admin/policies/{name}", |cx, req| {
            Box::pin(get(cx, req))
        }),
        Route::new(Method::PUT, "/admin/policies/{name}", |cx, req| {
            Box::pin(put(cx, req))
        })
        .with_body_limit(MAX_UPLOAD_BYTES),
    ]
}

/// The policy host of this server's data dir, opened on first use.
pub fn policy_host(state: &AppState) -> Result<Arc<PolicyHost>, PolicyError> {
    state.app.policies.open()
}

/// Policy metrics in Prometheus text, for `/metrics`. Empty when no policy
/// was ever stored under the data dir (so scrapes create no directories).
pub fn render_metrics(state: &AppState) -> String {
    if !state.app.policies.stored() {
        return String::new();
    }
    match policy_host(state) {
        Ok(h) => render_prometheus(&h.metrics()),
        Err(e) => {
            tracing::warn!(error = %e, "policy metrics unavailable");
            String::new()
        }
    }
}

/// Runs blocking host work (compiling takes tens of milliseconds) off the
/// async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, PolicyError> + Send + 'static,
) -> Result<Result<T, PolicyError>, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("policy task failed: {e}")))
}

fn bad_param(param: &str, message: String) -> ApiError {
    ApiError::InvalidRequest {
        message,
        param: Some(param.to_string()),
    }
}

fn parse<T: std::str::FromStr>(
    q: &HashMap<String, String>,
    key: &str,
) -> Result<Option<T>, ApiError>
where
    T::Err: std::fmt::Display,
{
    q.get(key)
        .map(|v| {
            v.parse::<T>()
                .map_err(|e| bad_param(key, format!("invalid {key} `{v}`: {e}")))
        })
        .transpose()
}

/// Upload options from the query string.
fn upload_options(q: &HashMap<String, String>) -> Result<(PolicyKind, PolicyOptions), ApiError> {
    let kind: PolicyKind = parse(q, "kind")?.ok_or_else(|| {
        bad_param(
            "kind",
            "query parameter kind is required (router, adapter-selector, dataset-transform)".into(),
        )
    })?;
    let on_error: OnError = parse(q, "on_error")?.unwrap_or_default();
    let defaults = kind.default_limits();
    let custom = [
        "deadline_ms",
        "fuel",
        "memory_mb",
        "warm_instances",
        "max_output_bytes",
    ]
    .iter()
    .any(|k| q.contains_key(*k));
    let limits = if custom {
        Some(Limits {
            deadline_ms: parse(q, "deadline_ms")?.unwrap_or(defaults.deadline_ms),
            fuel: match q.get("fuel").map(String::as_str) {
                Some("none" | "unlimited") => None,
                _ => parse(q, "fuel")?.or(defaults.fuel),
            },
            memory_bytes: parse::<usize>(q, "memory_mb")?
                .map_or(defaults.memory_bytes, |mb| mb.saturating_mul(1 << 20)),
            warm_instances: parse(q, "warm_instances")?.unwrap_or(defaults.warm_instances),
            max_output_bytes: parse(q, "max_output_bytes")?.unwrap_or(defaults.max_output_bytes),
        })
    } else {
        None
    };
    Ok((
        kind,
        PolicyOptions {
            limits,
            on_error,
            config: q.get("config").cloned(),
        },
    ))
}

fn name_param(cx: &Ctx) -> String {
    cx.param("name").unwrap_or_default().to_string()
}

async fn put(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let name = name_param(&cx);
    let (kind, opts) = upload_options(&body::query_params(&req)?)?;
    let bytes = body::read_bytes(req).await?;
    let state = cx.state.clone();
    let res = blocking(move || {
        let host = policy_host(&state)?;
        host.upload(&name, kind, &bytes, opts)
    })
    .await?;
    match res {
        Ok(info) => {
            let status = if info.version == 1 {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            tracing::info!(policy = %info.name, kind = %info.kind, version = info.version,
                sha256 = %info.sha256, "policy uploaded");
            body::json(status, &info)
        }
        Err(e) => Err(e.into()),
    }
}

async fn list(cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    let host = policy_host(&cx.state)?;
    body::json(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": host.list(),
            "bindings": {
                "router": host.binding(PolicyKind::Router),
                "adapter-selector": host.binding(PolicyKind::AdapterSelector),
            },
        }),
    )
}

async fn get(cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    let name = name_param(&cx);
    let host = policy_host(&cx.state)?;
    match host.get(&name) {
        Ok(info) => {
            let metrics = host.metrics().into_iter().find(|m| m.name == name);
            let mut v = serde_json::to_value(&info)
                .map_err(|e| ApiError::Internal(format!("encoding policy info: {e}")))?;
            v["metrics"] = serde_json::to_value(metrics).unwrap_or_default();
            body::json(StatusCode::OK, &v)
        }
        Err(e) => Err(e.into()),
    }
}

async fn delete(cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    let name = name_param(&cx);
    let state = cx.state.clone();
    let n = name.clone();
    match blocking(move || policy_host(&state)?.remove(&n)).await? {
        Ok(()) => body::json(StatusCode::OK, &json!({"name": name, "deleted": true})),
        Err(e) => Err(e.into()),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BindingBody {
    policy: Option<String>,
}

async fn put_binding(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let raw = cx.param("kind").unwrap_or_default().to_string();
    let kind: PolicyKind = raw.parse().map_err(|e: String| bad_param("kind", e))?;
    let b: BindingBody = body::read_json(req).await?;
    let state = cx.state.clone();
    let policy = b.policy.clone();
    let res = blocking(move || {
        let host = policy_host(&state)?;
        match &policy {
            Some(name) => host.bind(kind, name),
            None => host.unbind(kind),
        }
    })
    .await?;
    match res {
        Ok(()) => body::json(StatusCode::OK, &json!({"kind": kind, "policy": b.policy})),
        Err(e) => Err(e.into()),
    }
}
