//! Anthropic's Messages API: `POST /v1/messages` (whole or streamed with
//! Anthropic's event grammar) and `POST /v1/messages/count_tokens`, on the
//! same engine, routing, adapters, prompt caches and tool calling as
//! `/v1/chat/completions`: the body becomes the chat request
//! ([`validate`]), the answer Anthropic's `message` ([`stream`] when
//! streamed). Errors on these paths, the gateway's own included (auth,
//! limits), use Anthropic's error shape ([`error_response`]).

pub mod stream;
pub mod translate;
pub mod validate;

use http::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use crate::engine::{FinishReason, ToolCall, Usage};
use crate::http::body::{self, ReqBody};
use crate::http::openai::validate::Endpoint;
use crate::http::openai::{
    ApiParams, HandlerResult, collect, events, start_blocking, start_chat, tools,
};
use crate::http::routing::{self, Routed};
use crate::http::{ApiError, Body, Ctx, Route};

/// The Messages routes, for the route table.
pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::POST, "/v1/messages", |cx, req| {
            Box::pin(create(cx, req))
        }),
        Route::new(Method::POST, "/v1/messages/count_tokens", |cx, req| {
            Box::pin(count_tokens(cx, req))
        }),
    ]
}

/// Where a Messages body keeps its prompt and output format.
const PARAMS: ApiParams = ApiParams {
    prompt: "messages",
    format: "output_config.format",
};

/// Whether errors on `path` take Anthropic's shape.
pub fn speaks(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

pub async fn create(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let local = match routing::dispatch(&cx, req, Endpoint::Messages).await? {
        Routed::Local(local) => local,
        Routed::Proxied(resp) => return Ok(resp),
    };
    let m = validate::messages_request(&local.json, false)?;
    let started = start_chat(&cx, &local, &m.common, m.messages, m.tools, PARAMS).await?;
    let parser = started.call_parser();
    let (model, prompt_tokens) = (started.model, started.prompt_tokens);
    let stream = started
        .streams
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::Internal("the engine started no generation".into()))?;
    let id = format!("msg_{}", cx.request_id);
    if m.common.stream {
        let frames = crate::http::openai::sse::writer_frames(
            stream::Writer::new(id, model.id, prompt_tokens, parser, m.common.stop.clone()),
            events(stream),
        );
        return Ok(crate::http::openai::sse::stream_response(frames));
    }
    let done = collect(events(stream), false)
        .await
        .map_err(|e| ApiError::from_engine(e, "messages"))?;
    let (text, calls) = match parser {
        Some(parser) => tools::read_answer(parser, &done.text),
        None => (Some(done.text), Vec::new()),
    };
    let mut content: Vec<Value> = Vec::new();
    if let Some(text) = text.filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    let (stop_reason, stop_sequence) = stop_reason(done.reason, calls.len(), &m.common.stop);
    content.extend(calls.into_iter().map(tool_use_block));
    body::json(
        StatusCode::OK,
        &json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model.id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage(done.usage),
        }),
    )
    .map(|resp| local.meter.timed(resp))
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt as
/// `/v1/messages` would send it (template, tools), no `max_tokens` needed.
pub async fn count_tokens(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let (head, body) = req.into_parts();
    let limit = head.extensions.get::<body::BodyLimit>().map_or(0, |l| l.0);
    let json = body::parse_json(&body::read_body(body, limit).await?)?;
    let m = validate::messages_request(&json, true)?;
    let model = cx.state.app.models.resolve(&m.common.model)?;
    let engine = model.engine.clone();
    let tokens = start_blocking(
        &cx,
        move || Ok(engine.chat_tokens(&m.messages, &m.tools)?.len()),
        "messages",
    )
    .await?;
    body::json(StatusCode::OK, &json!({"input_tokens": tokens}))
}

/// Anthropic's `stop_reason` and `stop_sequence` (the request's `stops`
/// say which string a `StopString` index is).
pub fn stop_reason(reason: FinishReason, calls: usize, stops: &[String]) -> (&'static str, Value) {
    match reason {
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::StopString(i) => ("stop_sequence", json!(stops.get(i))),
        FinishReason::Stop if calls > 0 => ("tool_use", Value::Null),
        FinishReason::Stop => ("end_turn", Value::Null),
    }
}

/// Anthropic's `usage`: `input_tokens` counts the prompt tokens not read
/// from a prompt cache; those are `cache_read_input_tokens`.
pub fn usage(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// A call as a `tool_use` block (`toolu_` ids, `input` an object).
pub fn tool_use_block(call: ToolCall) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": tool_use_id(&call.id), "name": call.name, "input": input})
}

/// Anthropic's spelling of a call id.
/// (An id already in Anthropic's spelling stays as it is.)
fn tool_use_id(call_id: &str) -> String {
    if call_id.starts_with("toolu_") {
        return call_id.to_owned();
    }
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// Anthropic's error `type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn error_json(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e.status()), "message": e.to_string()}})
}

/// `e` as the gateway answers it (status and headers), in Anthropic's
/// error shape.
pub fn error_response(e: ApiError) -> Response<Body> {
    let body = error_json(&e).to_string();
    let (parts, _) = e.into_response().into_parts();
    Response::from_parts(parts, body::full(body.into_bytes()))
}
