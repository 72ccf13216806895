//! Routing in the request path: asks the bound router policy where an
//! inference request goes (a local model, a configured upstream, or a
//! refusal) before any local model is touched.
//!
//! The inference handlers call [`dispatch`] first thing:
//!
//! ```ignore
//! let json = match routing::dispatch(&cx, req).await? {
//!     Routed::Local(local) => local.json, // `model` already set to the chosen local model
//!     Routed::Proxied(resp) => return Ok(resp),
//! };
//! ```
//!
//! With no router bound the request takes the default route: the upstream
//! whose `[[upstreams]] models` lists the requested model, otherwise the
//! requested model locally, untouched. A failing guest configured `fail_open`
//! also takes the default route; one configured `fail_closed` refuses the
//! request with 503. Guest calls never run on the
//! async worker: they go to the policy host's few call threads
//! (`policy/pool.rs`) and are awaited, bounded by the policy's deadline
//! (5 ms by default, at most 1 s for request-time policies); a full call
//! queue is a guest failure, so `fail_open` / `fail_closed` applies. A
//! router that declared its decision inputs is called once per distinct
//! combination of them (`policy/reuse.rs`); a reused decision is a table
//! lookup, answered inline without a thread hop.

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::Value;

use super::admin_policies::open_host;
use super::body::{self, Body, BodyLimit, ReqBody};
use super::upstream::{self, Outgoing, Upstream, UpstreamError, UpstreamSpec, Upstreams};
use super::{ApiError, AppState, Caller, Ctx, Route};
use crate::policy::{
    BackendKind, BackendState, PolicyError, PolicyHost, RequestFacts, RouteDecision,
};

/// `GET /admin/upstreams`: each configured upstream's health, last error
/// and in-flight count, as the router sees them.
pub fn routes() -> Vec<Route> {
    vec![Route::new(Method::GET, "/admin/upstreams", |cx, _req| {
        Box::pin(async move {
            let data = cx.state.routing.upstreams.statuses();
            body::json(
                StatusCode::OK,
                &serde_json::json!({"object": "list", "data": data}),
            )
        })
    })]
}

/// Request headers a router policy sees (lower-case), when present. Typed
/// names: looking a header up by `&str` parses and checks the name first.
pub static POLICY_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("x-tenant"),
    HeaderName::from_static("x-priority"),
    HeaderName::from_static("x-user"),
];

/// Longest header value passed to a policy; longer ones are cut.
const MAX_HEADER_VALUE: usize = 256;

/// Routing state shared by all requests: the upstreams and the policy host.
pub struct Routing {
    pub upstreams: Upstreams,
    /// Opened on the first request that finds a policy store.
    host: OnceLock<Arc<PolicyHost>>,
}

impl Routing {
    pub fn new(upstreams: &[UpstreamSpec]) -> Routing {
        Routing {
            upstreams: Upstreams::new(upstreams),
            host: OnceLock::new(),
        }
    }
}

/// Where a request goes.
#[derive(Clone)]
pub enum Destination {
    /// Serve with this local model.
    Local { model: String },
    /// Forward to this configured upstream, with `model` rewritten if given.
    Upstream {
        upstream: Arc<Upstream>,
        model: Option<String>,
    },
}

/// A request refused by routing, or an upstream that failed.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The router's `reject(status, message)`.
    #[error("{message}")]
    Rejected { status: StatusCode, message: String },
    /// The router failed and is configured `fail_closed`, or the policy
    /// store could not be opened.
    #[error("{0}")]
    PolicyFailed(String),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
}

impl RouteError {
    pub fn status(&self) -> StatusCode {
        match self {
            RouteError::Rejected { status, .. } => *status,
            RouteError::PolicyFailed(_) => StatusCode::SERVICE_UNAVAILABLE,
            RouteError::Upstream(e) => e.status(),
        }
    }

    /// The OpenAI `type` field.
    pub fn error_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            409 => "conflict_error",
            429 => "rate_limit_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            RouteError::Rejected { .. } => "policy_rejected",
            RouteError::PolicyFailed(_) => "policy_failed",
            RouteError::Upstream(e) => e.code(),
        }
    }
}

impl From<UpstreamError> for ApiError {
    fn from(e: UpstreamError) -> Self {
        ApiError::Route(RouteError::Upstream(e))
    }
}

/// The facts a router sees, from the request head and what the handler
/// knows, borrowed from them. `prompt_tokens` is 0 when not counted yet.
#[allow(clippy::too_many_arguments)]
pub fn request_facts<'a>(
    method: &'a Method,
    path: &'a str,
    headers: &'a HeaderMap,
    caller: Option<&'a Caller>,
    model: &'a str,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
    streaming: bool,
) -> RequestFacts<'a> {
    let mut selected = Vec::new();
    for n in &POLICY_HEADERS {
        let Some(v) = headers.get(n).and_then(|v| v.to_str().ok()) else {
            continue;
        };
        let mut end = v.len().min(MAX_HEADER_VALUE);
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        selected.push((n.as_str(), &v[..end]));
    }
    RequestFacts {
        method: method.as_str(),
        path,
        model,
        headers: selected,
        api_key_id: caller.map(|c| c.key_id.as_str()),
        tenant: caller.map(|c| c.tenant.as_str()),
        prompt_tokens,
        max_tokens,
        streaming,
    }
}

/// The policy host, if this data dir has a policy store. Cached once found,
/// so the common case costs one atomic load.
pub(crate) async fn policy_host(state: &AppState) -> Result<Option<Arc<PolicyHost>>, RouteError> {
    if let Some(h) = state.routing.host.get() {
        return Ok(Some(Arc::clone(h)));
    }
    if !state.config.data_dir.join("policies").is_dir() {
        return Ok(None);
    }
    let dir = state.config.data_dir.clone();
    let opened = tokio::task::spawn_blocking(move || open_host(&dir))
        .await
        .map_err(|e| RouteError::PolicyFailed(format!("policy host task failed: {e}")))?;
    match opened {
        Ok(h) => Ok(Some(Arc::clone(state.routing.host.get_or_init(|| h)))),
        Err(e) => {
            tracing::error!(error = %e, "cannot open the policy store; refusing routed requests");
            Err(RouteError::PolicyFailed(format!(
                "request refused: the routing policy store cannot be opened ({})",
                e.code()
            )))
        }
    }
}

/// Backend states for the router: each ready local model, each upstream.
/// Local load comes from each model's engine (live streams, not yet admitted).
fn backends(state: &AppState) -> Vec<BackendState> {
    let mut out: Vec<BackendState> = state
        .models
        .ready()
        .into_iter()
        .map(|m| {
            let (in_flight, queued) = m.engine.current_load();
            BackendState {
                name: m.id,
                kind: BackendKind::Local,
                healthy: true,
                in_flight: in_flight as u32,
                queue_depth: queued as u32,
            }
        })
        .collect();
    out.extend(
        state
            .routing
            .upstreams
            .statuses()
            .into_iter()
            .map(|u| BackendState {
                name: u.name,
                kind: BackendKind::Upstream,
                healthy: u.healthy,
                in_flight: u.in_flight,
                queue_depth: 0,
            }),
    );
    out
}

/// Where a request goes when no policy decides: the upstream that lists the
/// model in its `models`, otherwise the requested model, locally.
fn default_route(state: &AppState, model: &str) -> Destination {
    match state.routing.upstreams.for_model(model) {
        Some(u) => Destination::Upstream {
            upstream: Arc::clone(u),
            model: None,
        },
        None => Destination::Local {
            model: model.to_owned(),
        },
    }
}

/// Decides where a request goes. No router bound: [`default_route`]; the
/// facts and backend states are only gathered when a router is bound.
pub async fn route_request<'a>(
    state: &AppState,
    model: &str,
    facts: impl FnOnce() -> RequestFacts<'a>,
) -> Result<Destination, ApiError> {
    let Some(host) = policy_host(state).await? else {
        return Ok(default_route(state, model));
    };
    match host.route_if_bound(facts, || backends(state)).await {
        Ok(RouteDecision::Local { model }) => Ok(Destination::Local { model }),
        Ok(RouteDecision::Upstream { name, model }) => match state.routing.upstreams.get(&name) {
            Some(u) => Ok(Destination::Upstream {
                upstream: Arc::clone(u),
                model,
            }),
            None => Err(UpstreamError::Unknown(name).into()),
        },
        Ok(RouteDecision::Reject { status, message }) => {
            let status = StatusCode::from_u16(status.clamp(400, 599))
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err(ApiError::Route(RouteError::Rejected { status, message }))
        }
        Err(e) if e.is_fail_open() => {
            if !matches!(e, PolicyError::NotBound(_)) {
                tracing::warn!(error = %e, "router policy failed; fail_open: default route");
            }
            Ok(default_route(state, model))
        }
        Err(e) => Err(fail_closed(&e, "routing")),
    }
}

/// The 503 for a policy that failed and is configured `fail_closed`;
/// `role` is `routing` or `adapter selection`.
pub(crate) fn fail_closed(e: &PolicyError, role: &str) -> ApiError {
    tracing::warn!(error = %e, role, "policy failed; fail_closed: refusing the request");
    let what = match e {
        PolicyError::Guest { policy, kind, .. } => {
            format!("the {role} policy `{policy}` failed ({kind})")
        }
        other => format!("{role} failed ({})", other.code()),
    };
    ApiError::Route(RouteError::PolicyFailed(format!(
        "request refused: {what} and is configured fail_closed"
    )))
}

/// What [`dispatch`] did with a request.
pub enum Routed {
    /// Serve locally: the parsed body, `model` set to the chosen local model.
    Local(Local),
    /// Answered by an upstream (or its failure): return as is.
    Proxied(Response<Body>),
}

/// A request to serve here: its body, and its head for what else the
/// handler needs (adapter selection reads headers and the caller).
pub struct Local {
    pub json: Value,
    pub head: http::request::Parts,
}

/// The request fields routing needs, read without building a JSON tree (a
/// proxied body is forwarded as received unless its model is rewritten).
#[derive(Deserialize)]
struct Peek<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stream: Option<bool>,
}

fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))
}

/// Sets `model` in a JSON object body (anything else is left alone).
fn set_model(json: &mut Value, model: String) {
    if let Some(obj) = json.as_object_mut() {
        obj.insert("model".to_owned(), Value::String(model));
    }
}

/// Reads the JSON body, routes the request and, for an upstream, proxies it.
/// Malformed JSON is a 400. A body whose routing fields have the wrong type
/// is left to the handler's validation, unrouted, which names the field.
/// A proxied body is forwarded as received (no JSON tree is built) unless
/// the decision rewrites its model.
pub async fn dispatch(cx: &Ctx, req: Request<ReqBody>) -> Result<Routed, ApiError> {
    let (head, body) = req.into_parts();
    let limit = head.extensions.get::<BodyLimit>().map_or(0, |l| l.0);
    let bytes = body::read_body(body, limit).await?;
    let Ok(peek) = serde_json::from_slice::<Peek>(&bytes) else {
        let json = parse_json(&bytes)?;
        return Ok(Routed::Local(Local { json, head }));
    };
    let requested = peek.model.as_deref().unwrap_or_default();
    let caller = head.extensions.get::<Caller>();
    let facts = || {
        let max_tokens = peek
            .max_completion_tokens
            .or(peek.max_tokens)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        request_facts(
            &head.method,
            head.uri.path(),
            &head.headers,
            caller,
            requested,
            0,
            max_tokens,
            peek.stream.unwrap_or(false),
        )
    };
    match route_request(&cx.state, requested, facts).await? {
        Destination::Local { model } => {
            let mut json = parse_json(&bytes)?;
            if model != requested {
                set_model(&mut json, model);
            }
            Ok(Routed::Local(Local { json, head }))
        }
        Destination::Upstream { upstream, model } => {
            let body = match model {
                Some(m) if m != requested => {
                    let mut json = parse_json(&bytes)?;
                    set_model(&mut json, m);
                    serde_json::to_vec(&json)
                        .map(Bytes::from)
                        .map_err(|e| ApiError::Internal(format!("re-encoding the body: {e}")))?
                }
                _ => bytes.clone(),
            };
            let path_and_query = head
                .uri
                .path_and_query()
                .map_or_else(|| head.uri.path(), |p| p.as_str());
            let resp = upstream::proxy(
                &upstream,
                Outgoing {
                    method: head.method.clone(),
                    path_and_query,
                    headers: &head.headers,
                    body,
                    request_id: &cx.request_id,
                },
            )
            .await?;
            Ok(Routed::Proxied(resp))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_take_selected_headers_only() {
        let mut h = HeaderMap::new();
        h.insert("x-tenant", "acme".parse().unwrap());
        h.insert("authorization", "Bearer secret".parse().unwrap());
        h.insert("x-priority", "a".repeat(300).parse().unwrap());
        let f = request_facts(
            &Method::POST,
            "/v1/chat/completions",
            &h,
            None,
            "m",
            0,
            Some(5),
            true,
        );
        assert_eq!(f.headers[0], ("x-tenant", "acme"));
        assert_eq!(f.headers.len(), 2);
        assert!(f.headers.iter().all(|(k, _)| *k != "authorization"));
        assert!(f.headers[1].1.len() <= MAX_HEADER_VALUE);
        assert_eq!((f.max_tokens, f.streaming), (Some(5), true));
    }

    #[test]
    fn route_errors_map_to_statuses() {
        let e = RouteError::Rejected {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: "slow down".into(),
        };
        assert_eq!(
            (e.status().as_u16(), e.error_type()),
            (429, "rate_limit_error")
        );
        assert_eq!(RouteError::PolicyFailed(String::new()).status(), 503);
    }
}
