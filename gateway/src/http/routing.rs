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
//! The decision itself is the app's (`App::route` in `app/routing.rs`):
//! this module reads what the router sees from the request (the body's
//! routing fields, selected headers, the caller) and carries the decision
//! out: the body parsed for a local model, or forwarded to the upstream.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Request, Response, StatusCode};
use serde_json::Value;

use super::body::{self, Body, BodyLimit, ReqBody};
use super::counting::{self, Counted};
use super::metering::{self, Meter, QuotaSlot};
use super::openai::validate::{self, Endpoint, RoutingFields};
use super::telemetry;
use super::upstream_usage::{self, UsageTap};
use super::{ApiError, Caller, Ctx, Route};
use crate::app::Destination;
use crate::policy::RequestFacts;
use crate::upstream::{self, Outgoing, Upstream};
use tracing::Instrument;

/// `GET /admin/upstreams`: each configured upstream's health, last error
/// and in-flight count, as the router sees them.
pub fn routes() -> Vec<Route> {
    vec![Route::new(Method::GET, "/admin/upstreams", |cx, _req| {
        Box::pin(async move {
            let data = cx.state.app.upstreams.statuses();
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

/// The synthetic header that tells policies what a request asks beyond
/// text ([`validate::RoutingFields::features`]); never taken from the
/// client.
pub const FEATURES_HEADER: &str = "x-mlxgate-features";

/// Longest header value passed to a policy; longer ones are cut.
const MAX_HEADER_VALUE: usize = 256;

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
    features: &'a str,
) -> RequestFacts<'a> {
    let mut selected = Vec::new();
    if !features.is_empty() {
        selected.push((FEATURES_HEADER, features));
    }
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
        quota: Default::default(),
    }
}

/// What [`dispatch`] did with a request.
pub enum Routed {
    /// Serve locally: the parsed body, `model` set to the chosen local model
    /// (boxed: it is large, and this is returned through every handler).
    Local(Box<Local>),
    /// Answered by an upstream (or its failure): return as is.
    Proxied(Response<Body>),
}

/// A request to serve here: its body, and its head for what else the
/// handler needs (adapter selection reads headers and the caller).
pub struct Local {
    pub json: Value,
    pub head: http::request::Parts,
    /// The prompt's token ids, when routing counted them (see
    /// [`counting`](super::counting)).
    pub counted: Option<Counted>,
    /// Its priority class while it waits for the model (the router's).
    pub priority: i8,
    /// Its token accounting; the handler hands it the answer's streams.
    pub meter: Meter,
}

/// Sets `model` in a JSON object body (anything else is left alone).
fn set_model(json: &mut Value, model: String) {
    if let Some(obj) = json.as_object_mut() {
        obj.insert("model".to_owned(), Value::String(model));
    }
}

/// The facts a router sees for a request whose body reads as `fields`
/// and whose prompt is `prompt_tokens` long.
pub fn routing_facts<'a>(
    head: &'a http::request::Parts,
    fields: &'a RoutingFields<'a>,
    prompt_tokens: u32,
) -> RequestFacts<'a> {
    request_facts(
        &head.method,
        head.uri.path(),
        &head.headers,
        head.extensions.get::<Caller>(),
        fields.model,
        prompt_tokens,
        fields
            .max_tokens
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        fields.stream,
        &fields.features,
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
    let started = std::time::Instant::now();
    let (head, body) = req.into_parts();
    let limit = head.extensions.get::<BodyLimit>().map_or(0, |l| l.0);
    let bytes = body::read_body(body, limit).await?;
    let picked = body::pick_json_fields(&bytes, &validate::ROUTING_FIELDS)?;
    let fields = validate::picked_routing_fields(&picked, endpoint)?;
    let caller = head.extensions.get::<Caller>();
    let quota = metering::peek(&cx.state, caller, fields.model).await;
    let (prompt_tokens, counted) = if cx.state.app.router_reads_prompt_tokens().await {
        counting::prompt_tokens(cx, endpoint, &bytes, &head, fields.model).await
    } else {
        (0, None)
    };
    let destination = cx
        .state
        .app
        .route(fields.model, || RequestFacts {
            quota,
            ..routing_facts(&head, &fields, prompt_tokens)
        })
        .instrument(telemetry::span(telemetry::Step::Route))
        .await?;
    let rewrite = match &destination {
        Destination::Local { model, .. } => (model != fields.model).then(|| model.clone()),
        Destination::Upstream {
            model: Some(model), ..
        } => (model != fields.model).then(|| model.clone()),
        Destination::Upstream { model: None, .. } => None,
    };
    // Limits are taken for the model the request is served as: a router
    // may send a caller over one model's budget to another.
    let (model, backend) = match &destination {
        Destination::Local { model, .. } => (model.as_str(), "local"),
        Destination::Upstream { order, model } => (
            model.as_deref().unwrap_or(fields.model),
            order[0].name.as_str(),
        ),
    };
    let slot = head.extensions.get::<QuotaSlot>();
    let plan = metering::admit(&cx.state, caller, model, slot).await?;
    let meter = Meter::new(&cx.state, caller, (model, backend), plan, started);
    let whole = |rewrite: Option<String>| -> Result<Value, ApiError> {
        let mut json = body::parse_json(&bytes)?;
        if let Some(model) = rewrite {
            set_model(&mut json, model);
        }
        Ok(json)
    };
    match destination {
        Destination::Local { priority, .. } => Ok(Routed::Local(Box::new(Local {
            json: whole(rewrite)?,
            head,
            counted,
            priority,
            meter,
        }))),
        Destination::Upstream { order, .. } => {
            let body = Forward {
                bytes: &bytes,
                json: &whole,
                rewrite,
                stream: fields.stream,
            };
            forward(cx, &head, endpoint, &order, (body, meter))
                .await
                .map(Routed::Proxied)
        }
    }
}

/// A call to upstreams: the order to try them in, how many at most, the
/// request's id and trace context, and the meter its usage goes to.
pub struct Call<'a> {
    pub order: &'a [Arc<Upstream>],
    pub max_attempts: usize,
    pub request_id: &'a str,
    pub traceparent: Option<String>,
    pub meter: Meter,
}

/// A body on its way upstream: as received, or re-encoded with the model
/// the decision named.
struct Forward<'a, F: Fn(Option<String>) -> Result<Value, ApiError>> {
    bytes: &'a Bytes,
    /// The whole body parsed, with `model` rewritten when given.
    json: &'a F,
    rewrite: Option<String>,
    stream: bool,
}

/// Sends a request to the first of `order` that answers, in the client's
/// API (a Messages request to an OpenAI-only upstream is translated), and
/// counts the answer's usage.
async fn forward<F: Fn(Option<String>) -> Result<Value, ApiError>>(
    cx: &Ctx,
    head: &http::request::Parts,
    endpoint: Endpoint,
    order: &[Arc<Upstream>],
    (body, meter): (Forward<'_, F>, Meter),
) -> Result<Response<Body>, ApiError> {
    let first = &order[0];
    let max_attempts = cx.state.app.config.proxy.max_attempts;
    let protocol = match endpoint {
        Endpoint::Messages => upstream::Protocol::Anthropic,
        Endpoint::Chat | Endpoint::Completions | Endpoint::Responses | Endpoint::Embeddings => {
            upstream::Protocol::Openai
        }
    };
    // Messages to an upstream of OpenAI's API only: translated.
    if protocol == upstream::Protocol::Anthropic
        && !first.speaks(protocol)
        && first.speaks(upstream::Protocol::Openai)
    {
        let json = (body.json)(body.rewrite)?;
        let span = telemetry::span(telemetry::Step::Upstream);
        let call = Call {
            order,
            max_attempts,
            request_id: &cx.request_id,
            traceparent: telemetry::traceparent(&span),
            meter,
        };
        let via = crate::http::anthropic::translate::via_openai(call, head, json);
        return via.instrument(span).await;
    }
    let bytes = match body.rewrite {
        Some(model) => serde_json::to_vec(&(body.json)(Some(model))?)
            .map(Bytes::from)
            .map_err(|e| ApiError::Internal(format!("re-encoding the body: {e}")))?,
        None => body.bytes.clone(),
    };
    // A streamed OpenAI answer reports usage only when asked, and every
    // upstream the request may reach must take the field.
    let asked = match endpoint {
        Endpoint::Chat | Endpoint::Completions
            if body.stream && order.iter().all(|u| u.stream_usage()) =>
        {
            upstream_usage::ask_for_usage(&bytes)
        }
        _ => None,
    };
    let strip = asked.is_some();
    let span = telemetry::span(telemetry::Step::Upstream);
    let traceparent = telemetry::traceparent(&span);
    let out = Outgoing {
        method: head.method.clone(),
        path_and_query: head
            .uri
            .path_and_query()
            .map_or_else(|| head.uri.path(), |p| p.as_str()),
        headers: &head.headers,
        body: asked.unwrap_or(bytes),
        request_id: &cx.request_id,
        protocol,
        traceparent: traceparent.as_deref(),
    };
    let resp = upstream::proxy_in_order(order, out, max_attempts)
        .instrument(span.clone())
        .await?;
    if let Some(name) = resp
        .headers()
        .get(&upstream::UPSTREAM_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        span.record("upstream", name);
    }
    Ok(count_usage(resp, strip, meter))
}

/// A proxied answer whose usage is counted into `meter` as it passes
/// ([`upstream_usage`]); `strip` takes out the usage chunk the gateway
/// asked for. Error answers pass untouched.
fn count_usage(resp: Response<upstream::ProxyBody>, strip: bool, meter: Meter) -> Response<Body> {
    let upstream = resp
        .headers()
        .get(&upstream::UPSTREAM_HEADER)
        .and_then(|v| v.to_str().ok());
    let Some(upstream) = upstream else {
        return resp.map(body::Body::new);
    };
    meter.answered_by(upstream);
    if !resp.status().is_success() {
        return resp.map(body::Body::new);
    }
    let events = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    let sink = Box::new(move |prompt, completion| meter.upstream_usage(prompt, completion));
    resp.map(|b| body::Body::new(UsageTap::new(b, events, strip, sink)))
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
            "tools=1,tool_choice=auto",
        );
        assert_eq!(f.headers[0], (FEATURES_HEADER, "tools=1,tool_choice=auto"));
        assert_eq!(f.headers[1], ("x-tenant", "acme"));
        assert_eq!(f.headers.len(), 3);
        assert!(f.headers.iter().all(|(k, _)| *k != "authorization"));
        assert!(f.headers[2].1.len() <= MAX_HEADER_VALUE);
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
        use crate::http::anthropic::validate::messages_request;
        use crate::http::openai::validate::{chat_request, completion_request};
        use crate::http::responses::validate::responses_request;

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
                Just("n"),
                Just("max_output_tokens"),
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
                        r#""messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi""#
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
                    let written: usize = ["model", "max_tokens", "max_completion_tokens", "stream", "n", "max_output_tokens"]
                        .iter()
                        .map(|k| text.matches(&format!("\"{k}\": ")).count())
                        .sum();
                    prop_assert!(plain.as_object().unwrap().len() - 3 < written, "{text}");
                    return Ok(());
                };
                prop_assert_eq!(&json, &serde_json::from_str::<Value>(&text).unwrap());
                let top = body::pick_json_fields(text.as_bytes(), &validate::ROUTING_FIELDS);
                prop_assert!(top.is_ok(), "{text}");
                let top = top.unwrap();
                for endpoint in [
                    Endpoint::Chat,
                    Endpoint::Completions,
                    Endpoint::Messages,
                    Endpoint::Responses,
                ] {
                    // What routing reads of the top level is what the whole
                    // parse gives validation.
                    prop_assert_eq!(
                        format!("{:?}", validate::picked_routing_fields(&top, endpoint)),
                        format!("{:?}", validate::routing_fields(&json, endpoint))
                    );
                    let served = match endpoint {
                        Endpoint::Chat => chat_request(&json).map(|r| r.common),
                        Endpoint::Completions => completion_request(&json).map(|r| r.common),
                        Endpoint::Messages => {
                            messages_request(&json, false).map(|r| r.common)
                        }
                        Endpoint::Responses => responses_request(&json).map(|r| r.common),
                        // Not in the list above: nothing is served locally.
                        Endpoint::Embeddings => continue,
                    };
                    let fields = validate::routing_fields(&json, endpoint);
                    match (fields, served) {
                        (Ok(fields), Ok(served)) => {
                            let facts = routing_facts(&head, &fields, 0);
                            prop_assert_eq!(facts.model, served.model.as_str());
                            prop_assert_eq!(
                                facts.max_tokens,
                                served.max_tokens.map(|n| n as u32)
                            );
                            prop_assert_eq!(facts.streaming, served.stream);
                            let features = served.n.gt(&1).then(|| format!("n={}", served.n));
                            prop_assert_eq!(
                                facts.headers.first().map(|h| h.1.to_owned()),
                                features
                            );
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
}
