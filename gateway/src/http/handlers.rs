//! Thin handlers for the built-in routes. They only read state and shape
//! responses; auth, limits, errors and metrics are the dispatcher's job.

use std::time::Duration;

use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use serde_json::json;

use super::body::{self, Body, ReqBody, full};
use super::{ApiError, Caller, Ctx, ModelState, Route};
use crate::app::models::Slot;

type HandlerResult = Result<Response<Body>, ApiError>;

/// Liveness: the process is up and serving.
pub async fn healthz(_cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    body::json(StatusCode::OK, &json!({"status": "ok"}))
}

/// Readiness: 200 once every configured model has loaded and while one can
/// take a request; 503 `overloaded` (with `Retry-After`) while every local
/// model's queue is full, so a load balancer sends work elsewhere. The body
/// shows each model's queue.
pub async fn readyz(cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    if let Some(reason) = cx.state.app.models.not_ready_reason() {
        return Err(ApiError::NotReady(reason));
    }
    let models = cx.state.app.models.ready();
    let stats: Vec<_> = models.iter().map(|m| m.engine.queue_stats()).collect();
    let queues: serde_json::Map<String, serde_json::Value> = models
        .iter()
        .zip(&stats)
        .map(|(m, q)| {
            (
                m.id.clone(),
                json!({"waiting": q.waiting, "max_queued": q.max_queued}),
            )
        })
        .collect();
    if !stats.is_empty() && stats.iter().all(|q| q.waiting >= q.max_queued) {
        return Err(ApiError::Overloaded {
            message: format!(
                "Every model's queue is full ({}); retry after the Retry-After header's seconds",
                serde_json::Value::Object(queues)
            ),
            tenant_share: false,
            retry_after: Duration::from_secs(1),
        });
    }
    let ids: Vec<&String> = models.iter().map(|m| &m.id).collect();
    body::json(
        StatusCode::OK,
        &json!({"status": "ready", "model": ids.first(), "models": ids, "queues": queues}),
    )
}

/// Prometheus text; who may scrape: [`super::metrics::authorize_scrape`].
pub async fn metrics(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    super::metrics::authorize_scrape(
        &cx.state.app.config.metrics,
        &cx.state.keys,
        req.headers(),
        cx.peer,
    )?;
    let ready = cx.state.app.models.all_ready();
    let text = cx.state.metrics.render(ready)
        + &super::metrics::render_model_queues(&cx.state.app.models.ready())
        + &super::admin_policies::render_metrics(&cx.state)
        + &super::prompt_caches::render_metrics(&cx.state);
    let mut resp = Response::new(full(text));
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(resp)
}

/// A local model as OpenAI lists it, plus what it serves (`capabilities`)
/// and, for models that embed, the vector size.
fn model_object(slot: &Slot) -> Option<serde_json::Value> {
    let (id, created, capabilities, dimensions) = match &slot.state {
        ModelState::Ready(m) => {
            let mut serves = vec!["chat.completions", "completions"];
            if slot.spec.embeddings {
                serves.push("embeddings");
            }
            let dimensions = slot.spec.embeddings.then(|| m.engine.card().hidden_size);
            (&m.id, m.created, serves, dimensions)
        }
        ModelState::ReadyEncoder(m) => (
            &m.id,
            m.created,
            vec!["embeddings"],
            Some(m.encoder.card().dimensions),
        ),
        _ => return None,
    };
    let mut object = json!({"id": id, "object": "model", "created": created, "owned_by": "mlxgate",
        "capabilities": capabilities});
    if let Some(dimensions) = dimensions {
        object["dimensions"] = json!(dimensions);
    }
    Some(object)
}

/// A model an upstream declares (`[[upstreams]] models`): `owned_by` names
/// the upstream; `created` is unknown (0).
fn upstream_model_object(model: &str, upstream: &str) -> serde_json::Value {
    json!({"id": model, "object": "model", "created": 0, "owned_by": upstream})
}

/// Every model a client can ask for now, as the default route sends it:
/// the local ones that can serve (one still loading is left out) unless an
/// upstream declares the same id, then those the upstreams declare.
fn all_models(cx: &Ctx) -> Vec<serde_json::Value> {
    let upstreams = &cx.state.app.upstreams;
    let local = cx.state.app.models.slots();
    let local = local.iter().filter_map(model_object).filter(|m| {
        m["id"]
            .as_str()
            .is_some_and(|id| upstreams.for_model(id).is_none())
    });
    let declared = upstreams.declared_models();
    local
        .chain(declared.map(|(model, upstream)| upstream_model_object(model, upstream)))
        .collect()
}

pub async fn list_models(cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    body::json(
        StatusCode::OK,
        &json!({"object": "list", "data": all_models(&cx)}),
    )
}

pub async fn get_model(cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    let id = cx.param("id").unwrap_or_default();
    match all_models(&cx).into_iter().find(|m| m["id"] == id) {
        Some(m) => body::json(StatusCode::OK, &m),
        None => Err(ApiError::ModelNotFound(id.to_owned())),
    }
}

/// Routes that only exist with `test_routes = true` (loopback only): they let
/// the integration tests hold a request open, panic a handler and send bodies,
/// without any test behaviour in the production routes.
pub fn test_routes() -> Vec<Route> {
    vec![
        Route::new(Method::POST, "/__test/echo", |cx, req| {
            Box::pin(test_echo(cx, req))
        }),
        Route::new(Method::GET, "/__test/panic", |cx, req| {
            Box::pin(test_panic(cx, req))
        }),
        Route::new(Method::GET, "/__test/sleep", |cx, req| {
            Box::pin(test_sleep(cx, req))
        }),
        Route::new(Method::GET, "/v1/__test/whoami", |cx, req| {
            Box::pin(test_whoami(cx, req))
        }),
    ]
}

async fn test_echo(_cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let value: serde_json::Value = body::read_json(req).await?;
    body::json(StatusCode::OK, &value)
}

/// Shows the [`Caller`] the dispatcher put into the request extensions.
async fn test_whoami(_cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let c = req
        .extensions()
        .get::<Caller>()
        .ok_or_else(|| ApiError::Internal("no caller in a /v1 request".into()))?;
    body::json(
        StatusCode::OK,
        &json!({"key_id": &*c.key_id, "tenant": &*c.tenant, "scopes": &*c.scopes}),
    )
}

async fn test_panic(_cx: Ctx, _req: Request<ReqBody>) -> HandlerResult {
    panic!("deliberate panic from /__test/panic");
}

/// `GET /__test/sleep?ms=N` answers after N milliseconds (at most a minute).
async fn test_sleep(_cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let ms = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("ms="))
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| ApiError::InvalidRequest {
            message: "query parameter ms (milliseconds) is required".into(),
            param: Some("ms".into()),
        })?
        .min(60_000);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    body::json(StatusCode::OK, &json!({"slept_ms": ms}))
}
