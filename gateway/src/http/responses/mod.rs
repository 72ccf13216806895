//! OpenAI's Responses API: `POST /v1/responses` (whole or streamed as
//! `response.*` events), `GET` and `DELETE /v1/responses/{id}`, on the same
//! engine, routing, adapters, prompt caches, tool calling and constrained
//! decoding as `/v1/chat/completions`.
//!
//! A response is stored (`store`, on by default) in the app's response
//! store with the conversation it ends, so `previous_response_id` continues
//! it (after restarts too); the previous response's `instructions` are not
//! carried over, as OpenAI documents.

pub mod stream;
pub mod validate;

use http::{Method, Request, StatusCode};
use serde_json::{Value, json};

use crate::app::responses::StoredResponse;
use crate::engine::{ChatMessage, FinishReason, ToolCall, Usage};
use crate::http::body::{self, ReqBody};
use crate::http::openai::validate::Endpoint;
use crate::http::openai::{ApiParams, HandlerResult, collect, events, start_chat, tools};
use crate::http::routing::{self, Routed};
use crate::http::{ApiError, Caller, Ctx, Route};
use crate::util::time::unix_secs;

pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::POST, "/v1/responses", |cx, req| {
            Box::pin(create(cx, req))
        }),
        Route::new(Method::GET, "/v1/responses/{id}", |cx, req| {
            Box::pin(get(cx, req))
        }),
        Route::new(Method::DELETE, "/v1/responses/{id}", |cx, req| {
            Box::pin(delete(cx, req))
        }),
    ]
}

/// Where a Responses body keeps its prompt and output format.
const PARAMS: ApiParams = ApiParams {
    prompt: "input",
    format: "text.format",
};

/// What a response echoes of its request, and what finishing it needs.
#[derive(Clone)]
pub struct Echo {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub request: Value,
    pub previous_response_id: Option<String>,
}

impl Echo {
    /// The response object: `status` `completed` (or `incomplete` when
    /// `max_output_tokens` cut it), its `output` items and `usage`.
    pub fn response(
        &self,
        status: &str,
        output: Vec<Value>,
        usage: Option<Usage>,
        reason: Option<FinishReason>,
    ) -> Value {
        let r = &self.request;
        let field = |k: &str, default: Value| {
            r.get(k)
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or(default)
        };
        let incomplete = matches!(reason, Some(FinishReason::Length));
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": if incomplete { "incomplete" } else { status },
            "error": null,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": field("instructions", Value::Null),
            "max_output_tokens": field("max_output_tokens", Value::Null),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": field("parallel_tool_calls", json!(true)),
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": field("store", json!(true)),
            "temperature": field("temperature", json!(1.0)),
            "text": field("text", json!({"format": {"type": "text"}})),
            "tool_choice": field("tool_choice", json!("auto")),
            "tools": field("tools", json!([])),
            "top_p": field("top_p", json!(1.0)),
            "truncation": "disabled",
            "usage": usage.map(usage_json),
            "user": field("user", Value::Null),
            "metadata": field("metadata", json!({})),
        })
    }
}

fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// A `message` output item holding `text`.
pub fn message_item(id: &str, text: &str) -> Value {
    json!({"type": "message", "id": id, "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

/// A `function_call` output item.
pub fn call_item(call: &ToolCall) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", call.id.trim_start_matches("call_")),
           "call_id": call.id, "name": call.name, "arguments": call.arguments, "status": "completed"})
}

/// Stores a finished response with its conversation, when asked to.
pub struct Keeper {
    pub store: Option<(std::sync::Arc<crate::http::AppState>, String)>,
    pub conversation: Vec<ChatMessage>,
}

impl Keeper {
    /// Stores `response`, the conversation extended by the answer.
    pub fn keep(self, echo: &Echo, response: &Value, text: &str, calls: Vec<ToolCall>) {
        let Some((state, tenant)) = self.store else {
            return;
        };
        let mut conversation = self.conversation;
        conversation.push(ChatMessage {
            tool_calls: calls,
            ..ChatMessage::text("assistant", text)
        });
        let row = StoredResponse {
            tenant,
            created_at: echo.created_at,
            response: response.clone(),
            conversation,
        };
        // A redb commit waits for the disk: on a work-stealing runtime, tell
        // it, so other requests move off this worker meanwhile (on a serving
        // thread, `http::serving`, it holds that thread for the commit).
        // Stored before the answer ends, so a `previous_response_id` sent
        // right after finds it.
        let put = || {
            state
                .app
                .responses()
                .and_then(|s| s.put(&echo.id, &row).map_err(|e| e.to_string()))
        };
        let stored = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(put),
            _ => put(),
        };
        if let Err(e) = stored {
            tracing::error!(id = %echo.id, error = %e, "storing a response failed");
        }
    }
}

pub(crate) fn tenant(req_caller: Option<&Caller>) -> String {
    req_caller.map(|c| c.tenant.to_string()).unwrap_or_default()
}

/// The conversation a request continues (its `previous_response_id`'s,
/// from the store) followed by its own input items, checked.
pub(crate) fn conversation(
    cx: &Ctx,
    r: &validate::ResponsesRequest,
    owner: &str,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut conversation = match &r.previous_response_id {
        Some(id) => {
            let store = cx.state.app.responses().map_err(ApiError::Internal)?;
            let previous = store
                .get(id, owner)
                .map_err(|e| ApiError::Internal(e.to_string()))?
                .ok_or_else(|| ApiError::NotFound {
                    message: format!("Previous response with id '{id}' not found."),
                    code: "previous_response_not_found",
                })?;
            previous.conversation
        }
        None => Vec::new(),
    };
    conversation.extend(r.input.iter().cloned());
    validate::check_outputs(&conversation)?;
    Ok(conversation)
}

/// The chat messages of a turn: `instructions` as the system message, then
/// the conversation.
pub(crate) fn chat_messages(
    r: &validate::ResponsesRequest,
    conversation: &[ChatMessage],
) -> Vec<ChatMessage> {
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(instructions) = &r.instructions {
        messages.push(ChatMessage::text("system", instructions));
    }
    messages.extend(conversation.iter().cloned());
    messages
}

pub async fn create(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let local = match routing::dispatch(&cx, req, Endpoint::Responses).await? {
        Routed::Local(local) => local,
        Routed::Proxied(resp) => return Ok(resp),
    };
    let r = validate::responses_request(&local.json)?;
    let owner = tenant(local.head.extensions.get::<Caller>());
    let store = if r.store {
        let store = cx.state.app.responses().map_err(ApiError::Internal)?;
        store.enabled().then(|| (cx.state.clone(), owner.clone()))
    } else {
        None
    };
    let conversation = conversation(&cx, &r, &owner)?;
    let messages = chat_messages(&r, &conversation);
    let started = start_chat(&cx, &local, &r.common, messages, r.tools.clone(), PARAMS).await?;
    let parser = started.call_parser();
    let model_id = started.model.id.clone();
    let stream = started
        .streams
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::Internal("the engine started no generation".into()))?;
    let echo = Echo {
        id: format!("resp_{}", cx.request_id),
        created_at: unix_secs(),
        model: model_id,
        request: local.json.clone(),
        previous_response_id: r.previous_response_id.clone(),
    };
    let keeper = Keeper {
        store,
        conversation,
    };
    if r.common.stream {
        let writer = stream::Writer::new(echo, parser, keeper);
        let frames = crate::http::openai::sse::writer_frames(writer, events(stream));
        return Ok(crate::http::openai::sse::stream_response(frames));
    }
    let done = collect(events(stream), false)
        .await
        .map_err(|e| ApiError::from_engine(e, "input"))?;
    let (text, calls) = match parser {
        Some(parser) => tools::read_answer(parser, &done.text),
        None => (Some(done.text), Vec::new()),
    };
    let text = text.unwrap_or_default();
    let mut output = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        output.push(message_item(&format!("msg_{}", cx.request_id), &text));
    }
    output.extend(calls.iter().map(call_item));
    let response = echo.response("completed", output, Some(done.usage), Some(done.reason));
    keeper.keep(&echo, &response, &text, calls);
    body::json(StatusCode::OK, &response).map(|resp| local.meter.timed(resp))
}

async fn get(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let id = cx.param("id").unwrap_or_default().to_owned();
    let owner = tenant(req.extensions().get::<Caller>());
    let store = cx.state.app.responses().map_err(ApiError::Internal)?;
    match store
        .get(&id, &owner)
        .map_err(|e| ApiError::Internal(e.to_string()))?
    {
        Some(row) => body::json(StatusCode::OK, &row.response),
        None => Err(not_found(&id)),
    }
}

async fn delete(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let id = cx.param("id").unwrap_or_default().to_owned();
    let owner = tenant(req.extensions().get::<Caller>());
    let store = cx.state.app.responses().map_err(ApiError::Internal)?;
    if !store
        .delete(&id, &owner)
        .map_err(|e| ApiError::Internal(e.to_string()))?
    {
        return Err(not_found(&id));
    }
    body::json(
        StatusCode::OK,
        &json!({"id": id, "object": "response", "deleted": true}),
    )
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        message: format!("Response with id '{id}' not found."),
        code: "response_not_found",
    }
}
