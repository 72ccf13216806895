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

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Request, Response, StatusCode};
use serde_json::Value;

use super::body::{self, Body, BodyLimit, ReqBody};
use super::openai::validate::{self, Endpoint, RoutingFields};
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

/// Routing state shared by all requests: the upstreams.
pub struct Routing {
    pub upstreams: Upstreams,
}

impl Routing {
    pub fn new(upstreams: &[UpstreamSpec]) -> Routing {
        Routing {
            upstreams: Upstreams::new(upstreams),
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
        super::error::type_for_status(self.status())
    }

    pub fn code(&self) -> &'static str {
        match self {
            RouteError::Rejected { .. } => "policy_rejected",
            RouteError::PolicyFailed(_) => "policy_failed",
            RouteError::Upstream(e) => e.code(),
        }
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
        api_key_id: caller.map(|c| &*c.key_id),
        tenant: caller.map(|c| &*c.tenant),
        prompt_tokens,
        max_tokens,
        streaming,
    }
}

/// The policy host, if this data dir has a policy store. Cached once found,
/// so the common case costs one atomic load.
pub(crate) async fn policy_host(state: &AppState) -> Result<Option<Arc<PolicyHost>>, RouteError> {
    if let Some(h) = state.policies.opened() {
        return Ok(Some(h));
    }
    if !state.policies.stored() {
        return Ok(None);
    }
    let policies = Arc::clone(&state.policies);
    let opened = tokio::task::spawn_blocking(move || policies.open())
        .await
        .map_err(|e| RouteError::PolicyFailed(format!("policy host task failed: {e}")))?;
    match opened {
        Ok(h) => Ok(Some(h)),
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

/// Sets `model` in a JSON object body (anything else is left alone).
fn set_model(json: &mut Value, model: String) {
    if let Some(obj) = json.as_object_mut() {
        obj.insert("model".to_owned(), Value::String(model));
    }
}

/// The facts a router sees for a request whose body reads as `fields`.
pub fn routing_facts<'a>(
    head: &'a http::request::Parts,
    fields: &RoutingFields<'a>,
) -> RequestFacts<'a> {
    request_facts(
        &head.method,
        head.uri.path(),
        &head.headers,
        head.extensions.get::<Caller>(),
        fields.model,
        0,
        fields
            .max_tokens
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        fields.stream,
    )
}

/// Reads the JSON body, routes the request and, for an upstream, proxies it.
///
/// The routing fields are read by validation's own readers
/// ([`validate::routing_fields`]) from the body's top level, parsed with
/// repeated keys refused ([`body::pick_json_fields`]), so the policy decides
/// on exactly what would be served: a body those cannot read is a 400 here,
/// never a request that skips the router. A body served here is then parsed
/// whole ([`body::parse_json`]: repeated keys refused at any depth); the same
/// top-level fields read the same either way. A proxied body is forwarded as
/// received unless the decision rewrites its model; the upstream judges what
/// this gateway does not read (tools, nested objects).
pub async fn dispatch(
    cx: &Ctx,
    req: Request<ReqBody>,
    endpoint: Endpoint,
) -> Result<Routed, ApiError> {
    let (head, body) = req.into_parts();
    let limit = head.extensions.get::<BodyLimit>().map_or(0, |l| l.0);
    let bytes = body::read_body(body, limit).await?;
    let picked = body::pick_json_fields(&bytes, &validate::ROUTING_FIELDS)?;
    let fields = validate::picked_routing_fields(&picked, endpoint)?;
    let destination =
        route_request(&cx.state, fields.model, || routing_facts(&head, &fields)).await?;
    let rewrite = match &destination {
        Destination::Local { model } => (model != fields.model).then(|| model.clone()),
        Destination::Upstream {
            model: Some(model), ..
        } => (model != fields.model).then(|| model.clone()),
        Destination::Upstream { model: None, .. } => None,
    };
    let whole = |rewrite: Option<String>| -> Result<Value, ApiError> {
        let mut json = body::parse_json(&bytes)?;
        if let Some(model) = rewrite {
            set_model(&mut json, model);
        }
        Ok(json)
    };
    match destination {
        Destination::Local { .. } => Ok(Routed::Local(Local {
            json: whole(rewrite)?,
            head,
        })),
        Destination::Upstream { upstream, .. } => {
            let body = match rewrite {
                Some(model) => serde_json::to_vec(&whole(Some(model))?)
                    .map(Bytes::from)
                    .map_err(|e| ApiError::Internal(format!("re-encoding the body: {e}")))?,
                None => bytes.clone(),
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

    mod one_reading {
        //! The facts a router sees and the request served are read from the
        //! same parse by the same readers: for every generated body (typed
        //! right or wrong, whole floats, repeated keys), either the gateway
        //! refuses it before routing, or validation's request has exactly
        //! the model, token budget and streaming flag the facts had.

        use proptest::prelude::*;

        use super::super::*;
        use crate::http::openai::validate::{chat_request, completion_request};

        /// JSON text for a value of a routing field, well- or ill-typed.
        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("null".to_owned()),
                any::<bool>().prop_map(|b| b.to_string()),
                (-3i64..70_000).prop_map(|n| n.to_string()),
                (0u32..9000).prop_map(|n| format!("{n}.0")),
                (0u32..9000).prop_map(|n| format!("{n}.5")),
                (0u32..9000).prop_map(|n| format!("{n}e0")),
                Just("1e300".to_owned()),
                Just("4294967296".to_owned()),
                "[a-z0-9ü -]{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
                Just(serde_json::to_string(&"m".repeat(300)).unwrap()),
                Just("[1, 2]".to_owned()),
                Just("{\"a\": 1}".to_owned()),
            ]
        }

        /// A body: some of the routing fields (any of them maybe twice),
        /// and what each endpoint needs, in any order.
        fn body() -> impl Strategy<Value = String> {
            let key = prop_oneof![
                Just("model"),
                Just("max_tokens"),
                Just("max_completion_tokens"),
                Just("stream"),
            ];
            (
                prop::collection::vec((key, value()), 0..6),
                any::<bool>(),
                any::<prop::sample::Index>(),
            )
                .prop_map(|(mut fields, with_model, at)| {
                    if with_model {
                        fields.push(("model", "\"m\"".to_owned()));
                    }
                    let mut parts: Vec<String> = fields
                        .into_iter()
                        .map(|(k, v)| format!("\"{k}\": {v}"))
                        .collect();
                    let i = at.index(parts.len() + 1);
                    parts.insert(
                        i,
                        r#""messages": [{"role": "user", "content": "hi"}], "prompt": "hi""#
                            .to_owned(),
                    );
                    format!("{{{}}}", parts.join(", "))
                })
        }

        fn head() -> http::request::Parts {
            Request::post("/v1/chat/completions")
                .body(())
                .unwrap()
                .into_parts()
                .0
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn the_router_decides_on_what_is_served(text in body()) {
                let head = head();
                let Ok(json) = body::parse_json(text.as_bytes()) else {
                    // Refused: only ever for a repeated key here, which
                    // routing's parse refuses too (all are routing fields).
                    prop_assert!(
                        body::pick_json_fields(text.as_bytes(), &validate::ROUTING_FIELDS).is_err()
                    );
                    let plain: Value = serde_json::from_str(&text).unwrap();
                    let written: usize = ["model", "max_tokens", "max_completion_tokens", "stream"]
                        .iter()
                        .map(|k| text.matches(&format!("\"{k}\": ")).count())
                        .sum();
                    prop_assert!(plain.as_object().unwrap().len() - 2 < written, "{text}");
                    return Ok(());
                };
                prop_assert_eq!(&json, &serde_json::from_str::<Value>(&text).unwrap());
                let top = body::pick_json_fields(text.as_bytes(), &validate::ROUTING_FIELDS);
                prop_assert!(top.is_ok(), "{text}");
                let top = top.unwrap();
                for endpoint in [Endpoint::Chat, Endpoint::Completions] {
                    // What routing reads of the top level is what the whole
                    // parse gives validation.
                    prop_assert_eq!(
                        format!("{:?}", validate::picked_routing_fields(&top, endpoint)),
                        format!("{:?}", validate::routing_fields(&json, endpoint))
                    );
                    let served = match endpoint {
                        Endpoint::Chat => chat_request(&json).map(|r| r.common),
                        Endpoint::Completions => completion_request(&json).map(|r| r.common),
                    };
                    let fields = validate::routing_fields(&json, endpoint);
                    match (fields, served) {
                        (Ok(fields), Ok(served)) => {
                            let facts = routing_facts(&head, &fields);
                            prop_assert_eq!(facts.model, served.model.as_str());
                            prop_assert_eq!(
                                facts.max_tokens,
                                served.max_tokens.map(|n| n as u32)
                            );
                            prop_assert_eq!(facts.streaming, served.stream);
                        }
                        // Refused before routing: nothing is served.
                        (Err(_), served) => prop_assert!(served.is_err(), "{text}"),
                        // Routed, then refused by the rest of validation.
                        (Ok(_), Err(_)) => {}
                    }
                }
            }
        }
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
