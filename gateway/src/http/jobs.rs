//! The jobs API under `/api/` (the dispatcher requires the `jobs` scope):
//!
//! - `POST /api/jobs` `{kind, config}` -> 201 with the row. `dataset`,
//!   `quantize` and `finetune` also need the `admin` scope.
//! - `GET /api/jobs?status=&kind=&limit=&cursor=` -> `{data, next_cursor}`,
//!   newest first.
//! - `GET /api/jobs/{id}` -> the row.
//! - `GET /api/jobs/{id}/events` -> server-sent events: the stored events
//!   from the start, then live ones until `done`/`failed`/`cancelled`. Each
//!   has `id: <seq>`; a `Last-Event-ID` header (or `?after=<seq>`) resumes
//!   after that event.
//! - `DELETE /api/jobs/{id}` -> cancels; 409 once the job has finished.
//!
//! A job belongs to the tenant of the key that submitted it (`tenant` in the
//! row). Getting, following and cancelling it takes a key of that tenant or
//! one with the `admin` scope; to anyone else it answers 404 like a job that
//! does not exist, and listing shows non-admins their tenant's jobs only.
//! Rows from before jobs had owners have no tenant: admins only.
//!
//! The service itself is the app's (`App::jobs`): opened when the server
//! starts, which also recovers rows of a previous process.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde::Deserialize;
use serde_json::Value;

use super::auth::{Caller, Scope};
use super::body::{self, Body, BoxError, ReqBody};
use super::{ApiError, Ctx, Route};
use crate::jobs::{Filter, Followed, JobError, JobKind, JobRow, JobStatus, Jobs, Page};

type HandlerResult = Result<Response<Body>, ApiError>;

/// The jobs routes; `AppState::new` extends the table with these.
pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::GET, "/api/jobs", |cx, req| Box::pin(list(cx, req))),
        Route::new(Method::POST, "/api/jobs", |cx, req| {
            Box::pin(submit(cx, req))
        }),
        Route::new(Method::DELETE, "/api/jobs/{id}", |cx, req| {
            Box::pin(cancel(cx, req))
        }),
        Route::new(Method::GET, "/api/jobs/{id}", |cx, req| {
            Box::pin(get(cx, req))
        }),
        Route::new(Method::GET, "/api/jobs/{id}/events", |cx, req| {
            Box::pin(events(cx, req))
        }),
    ]
}

pub(super) fn jobs(cx: &Ctx) -> Result<Arc<Jobs>, ApiError> {
    Ok(cx.state.app.jobs()?)
}

fn bad(param: &str, message: String) -> ApiError {
    ApiError::InvalidRequest {
        message,
        param: Some(param.to_owned()),
    }
}

#[derive(Deserialize)]
struct SubmitBody {
    kind: Option<Value>,
    #[serde(default)]
    config: Value,
}

/// The caller the dispatcher attached; every `/api/` request has one, and
/// refusing without one keeps jobs closed should that ever change.
fn caller(req: &Request<ReqBody>) -> Result<Caller, ApiError> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| ApiError::Internal("a jobs request without a caller".into()))
}

/// The job `id` if `caller` may see it; another tenant's job is "not found",
/// exactly as one that does not exist.
async fn owned_job(cx: &Ctx, caller: &Caller, id: &str) -> Result<JobRow, ApiError> {
    let row = jobs(cx)?.get(id).await?;
    if !row.visible_to(&caller.tenant, caller.has(Scope::Admin)) {
        return Err(JobError::NotFound(id.to_owned()).into());
    }
    Ok(row)
}

async fn submit(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let caller = caller(&req)?;
    let b: SubmitBody = body::read_json(req).await?;
    let kind: JobKind = match b.kind {
        Some(Value::String(s)) => s.parse().map_err(|e: String| bad("kind", e))?,
        Some(_) => return Err(bad("kind", "`kind` must be a string".into())),
        None => return Err(bad("kind", "`kind` is required".into())),
    };
    if kind.needs_admin() {
        cx.state.keys.require(Some(&caller), Scope::Admin)?;
    }
    let row = jobs(&cx)?
        .submit(
            kind,
            b.config,
            Some(caller.key_id.to_string()),
            Some(caller.tenant.to_string()),
        )
        .await?;
    body::json(StatusCode::CREATED, &row)
}

async fn list(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let caller = caller(&req)?;
    let q = body::query_params(&req)?;
    let mut filter = Filter {
        tenant: (!caller.has(Scope::Admin)).then(|| caller.tenant.to_string()),
        ..Filter::default()
    };
    if let Some(s) = q.get("status").filter(|s| !s.is_empty()) {
        filter.status = Some(s.parse::<JobStatus>().map_err(|e| bad("status", e))?);
    }
    if let Some(k) = q.get("kind").filter(|s| !s.is_empty()) {
        filter.kind = Some(k.parse::<JobKind>().map_err(|e| bad("kind", e))?);
    }
    let mut page = Page::default();
    if let Some(l) = q.get("limit") {
        page.limit = l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=crate::jobs::ledger::MAX_PAGE).contains(n))
            .ok_or_else(|| {
                bad(
                    "limit",
                    format!("`limit` must be 1..={}", crate::jobs::ledger::MAX_PAGE),
                )
            })?;
    }
    if let Some(c) = q.get("cursor").filter(|s| !s.is_empty()) {
        if !c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(bad("cursor", "`cursor` is not a job id".into()));
        }
        page.cursor = Some(c.clone());
    }
    let listing = jobs(&cx)?.list(filter, page).await?;
    body::json(StatusCode::OK, &listing)
}

fn id_param(cx: &Ctx) -> Result<String, ApiError> {
    cx.param("id")
        .map(str::to_owned)
        .ok_or_else(|| ApiError::Internal("route without an id".into()))
}

async fn get(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let id = id_param(&cx)?;
    let row = owned_job(&cx, &caller(&req)?, &id).await?;
    body::json(StatusCode::OK, &row)
}

async fn cancel(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let id = id_param(&cx)?;
    // The owner never changes, so checking before cancelling is enough.
    owned_job(&cx, &caller(&req)?, &id).await?;
    let row = jobs(&cx)?.cancel(&id).await?;
    body::json(StatusCode::OK, &row)
}

async fn events(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let id = id_param(&cx)?;
    owned_job(&cx, &caller(&req)?, &id).await?;
    let header = req
        .headers()
        .get("last-event-id")
        .map(|v| v.to_str().unwrap_or("").trim().to_owned());
    let query = body::query_params(&req)?;
    let after = match header.or_else(|| query.get("after").cloned()) {
        None => 0,
        Some(s) if s.is_empty() => 0,
        Some(s) => s
            .parse::<u64>()
            .map_err(|_| bad("Last-Event-ID", format!("`{s}` is not an event id")))?,
    };
    let stream = jobs(&cx)?.follow(&id, after).await?;
    let frames = stream.map(|item| {
        let text = match item {
            Followed::Event(e) => {
                // Stored events are plain JSON values: this cannot fail.
                let json = serde_json::to_string(&e).unwrap_or_default();
                format!("id: {}\ndata: {json}\n\n", e.seq)
            }
            Followed::Idle => ": keep-alive\n\n".to_owned(),
        };
        Ok::<_, BoxError>(Frame::data(Bytes::from(text)))
    });
    let mut resp = Response::new(StreamBody::new(frames).boxed_unsync());
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(resp)
}
