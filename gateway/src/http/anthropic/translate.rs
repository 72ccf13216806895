//! A Messages request routed to an upstream that speaks only OpenAI's API:
//! sent as a chat completion, answered in Anthropic's shape.
//!
//! The body is read as `/v1/messages` serves it ([`super::validate`]) and
//! written as OpenAI's chat request: `system` and turns as messages,
//! `tool_use` / `tool_result` as `tool_calls` / `tool` messages, `tools`
//! and `tool_choice` as function tools, `stop_sequences` as `stop`,
//! `output_config.format` as `response_format`; `top_k` has no OpenAI
//! field and is dropped. The answer comes back as a `message` (whole), or
//! its chunks as Anthropic's events (streamed, with `stream_options.
//! include_usage` asked for so `message_delta` has the usage); an error
//! answer keeps its status, in Anthropic's error shape.

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};

use super::stream::event;
use super::tool_use_id;
use super::validate::{MessagesRequest, messages_request};
use crate::engine::{Grammar, ToolChoice};
use crate::http::body;
use crate::http::openai::sse::stream_response;
use crate::http::routing::Call;
use crate::http::upstream_usage::UsageTap;
use crate::http::{ApiError, Body};
use crate::upstream::{self, Outgoing, Protocol};

/// Largest whole answer read back for translation.
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// Sends Messages `body` (model already as routed) as a chat completion to
/// the first of `order` that answers (the fallback order of any proxied
/// request, at most `max_attempts` asked; one that does not speak OpenAI's
/// API is passed over) and answers in Anthropic's shape.
pub async fn via_openai(
    call: Call<'_>,
    head: &http::request::Parts,
    body: Value,
) -> Result<Response<Body>, ApiError> {
    let request = messages_request(&body, false)?;
    let model = request.common.model.clone();
    let stream = request.common.stream;
    let chat = serde_json::to_vec(&chat_body(&body, &request))
        .map_err(|e| ApiError::Internal(format!("encoding the chat request: {e}")))?;
    let resp = upstream::proxy_in_order(
        call.order,
        Outgoing {
            method: http::Method::POST,
            path_and_query: "/v1/chat/completions",
            headers: &head.headers,
            body: Bytes::from(chat),
            request_id: call.request_id,
            protocol: Protocol::Openai,
            traceparent: call.traceparent.as_deref(),
        },
        call.max_attempts,
    )
    .await
    .map_err(crate::app::RouteError::Upstream)?;
    let (mut parts, incoming) = resp.into_parts();
    parts.headers.remove(http::header::CONTENT_LENGTH);
    if let Some(name) = parts
        .headers
        .get(&upstream::UPSTREAM_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        call.meter.answered_by(name);
        // The `upstream` span this call runs in (traces on).
        tracing::Span::current().record("upstream", name);
    }
    // The chat answer's usage, read on its way to translation.
    let meter = call.meter;
    let sink = Box::new(move |prompt, completion| meter.upstream_usage(prompt, completion));
    let incoming = UsageTap::new(incoming, stream, false, sink);
    if !parts.status.is_success() {
        let text = read(incoming).await;
        let message = serde_json::from_slice::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&text).into_owned());
        let e = json!({"type": "error", "error": {"type": super::error_type(parts.status), "message": message}});
        return Ok(Response::from_parts(parts, body::full(e.to_string())));
    }
    if stream {
        let mut writer = ChunkWriter::new(model);
        let mut buffer = String::new();
        let frames = incoming.into_data_stream().map(move |chunk| match chunk {
            Ok(bytes) => {
                buffer.push_str(&String::from_utf8_lossy(&bytes));
                writer.feed(&mut buffer)
            }
            Err(_) => writer.error("the upstream's answer broke off"),
        });
        let mut resp = stream_response(frames.filter(|f| std::future::ready(!f.is_empty())));
        *resp.status_mut() = StatusCode::OK;
        copy_upstream_name(&parts.headers, resp.headers_mut());
        return Ok(resp);
    }
    let text = read(incoming).await;
    let answer: Value = serde_json::from_slice(&text).map_err(|e| {
        ApiError::Internal(format!(
            "the upstream's answer is not a chat completion: {e}"
        ))
    })?;
    let mut resp = body::json(StatusCode::OK, &message(&answer, &model))?;
    copy_upstream_name(&parts.headers, resp.headers_mut());
    Ok(resp)
}

fn copy_upstream_name(from: &http::HeaderMap, to: &mut http::HeaderMap) {
    if let Some(v) = from.get("x-mlxgate-upstream") {
        to.insert("x-mlxgate-upstream", v.clone());
    }
}

async fn read<B>(incoming: B) -> Bytes
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<crate::http::BoxError>,
{
    match http_body_util::Limited::new(incoming, MAX_ANSWER_BYTES)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(_) => Bytes::new(),
    }
}

/// OpenAI's chat request for a Messages request.
fn chat_body(original: &Value, r: &MessagesRequest) -> Value {
    let messages: Vec<Value> = r
        .messages
        .iter()
        .map(|m| {
            let mut out = json!({"role": m.role, "content": m.content});
            if !m.tool_calls.is_empty() {
                out["tool_calls"] = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        json!({"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}})
                    })
                    .collect();
            }
            if let Some(id) = &m.tool_call_id {
                out["tool_call_id"] = json!(id);
            }
            out
        })
        .collect();
    let mut chat =
        json!({"model": r.common.model, "messages": messages, "stream": r.common.stream});
    if let Some(max) = r.common.max_tokens {
        chat["max_tokens"] = json!(max);
    }
    for key in ["temperature", "top_p"] {
        if let Some(v) = original.get(key).filter(|v| !v.is_null()) {
            chat[key] = v.clone();
        }
    }
    if !r.common.stop.is_empty() {
        chat["stop"] = json!(r.common.stop);
    }
    if r.common.stream {
        chat["stream_options"] = json!({"include_usage": true});
    }
    if !r.tools.tools.is_empty() {
        chat["tools"] = r
            .tools
            .tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {"name": t.name,
                            "description": t.description, "parameters": t.parameters}})
            })
            .collect();
        chat["tool_choice"] = match &r.tools.choice {
            ToolChoice::Auto => json!("auto"),
            ToolChoice::None => json!("none"),
            ToolChoice::Required => json!("required"),
            ToolChoice::Function(name) => json!({"type": "function", "function": {"name": name}}),
        };
        chat["parallel_tool_calls"] = json!(r.tools.parallel);
    }
    if let Some(Grammar::JsonSchema(schema)) = &r.common.grammar {
        chat["response_format"] =
            json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}});
    }
    chat
}

/// Anthropic's `stop_reason` for OpenAI's `finish_reason`.
fn stop_reason(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

fn usage(u: &Value) -> Value {
    json!({
        "input_tokens": u["prompt_tokens"].as_u64().unwrap_or(0),
        "output_tokens": u["completion_tokens"].as_u64().unwrap_or(0),
        "cache_read_input_tokens": u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        "cache_creation_input_tokens": 0,
    })
}

/// A whole chat completion as a Messages `message`.
fn message(answer: &Value, model: &str) -> Value {
    let choice = &answer["choices"][0];
    let m = &choice["message"];
    let mut content = Vec::new();
    if let Some(text) = m["content"].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in m["tool_calls"].as_array().into_iter().flatten() {
        let arguments = call["function"]["arguments"].as_str().unwrap_or("{}");
        let input: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
        content.push(
            json!({"type": "tool_use", "id": tool_use_id(call["id"].as_str().unwrap_or("call")),
                            "name": call["function"]["name"], "input": input}),
        );
    }
    json!({
        "id": format!("msg_{}", answer["id"].as_str().unwrap_or("upstream")),
        "type": "message",
        "role": "assistant",
        "model": answer["model"].as_str().unwrap_or(model),
        "content": content,
        "stop_reason": stop_reason(choice["finish_reason"].as_str()),
        "stop_sequence": null,
        "usage": usage(&answer["usage"]),
    })
}

/// Streamed chat chunks as Anthropic's events.
struct ChunkWriter {
    model: String,
    started: bool,
    /// The open block: its index and whether it is text.
    open: Option<(usize, bool)>,
    blocks: usize,
    finish: Option<String>,
    usage: Value,
    done: bool,
}

impl ChunkWriter {
    fn new(model: String) -> ChunkWriter {
        ChunkWriter {
            model,
            started: false,
            open: None,
            blocks: 0,
            finish: None,
            usage: json!({}),
            done: false,
        }
    }

    /// Events for every whole SSE event in `buffer` (taken out of it).
    fn feed(&mut self, buffer: &mut String) -> String {
        let mut out = String::new();
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    out += &self.finish();
                } else if let Ok(chunk) = serde_json::from_str::<Value>(data) {
                    out += &self.chunk(&chunk);
                }
            }
        }
        out
    }

    fn start(&mut self, chunk: &Value) -> String {
        if self.started {
            return String::new();
        }
        self.started = true;
        let id = format!("msg_{}", chunk["id"].as_str().unwrap_or("upstream"));
        let model = chunk["model"].as_str().unwrap_or(&self.model).to_owned();
        event(
            "message_start",
            &json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
                    "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0}}}),
        ) + &event("ping", &json!({"type": "ping"}))
    }

    fn close(&mut self) -> String {
        match self.open.take() {
            Some((index, _)) => event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ),
            None => String::new(),
        }
    }

    fn open(&mut self, block: Value, text: bool) -> (String, usize) {
        let out = self.close();
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, text));
        let start = event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
        (out + &start, index)
    }

    fn chunk(&mut self, chunk: &Value) -> String {
        let mut out = self.start(chunk);
        if chunk["usage"].is_object() {
            self.usage = usage(&chunk["usage"]);
        }
        let Some(choice) = chunk["choices"].get(0) else {
            return out;
        };
        let delta = &choice["delta"];
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            let index = match self.open {
                Some((index, true)) => index,
                _ => {
                    let (started, index) = self.open(json!({"type": "text", "text": ""}), true);
                    out += &started;
                    index
                }
            };
            out += &event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": text}}),
            );
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            if let Some(id) = call["id"].as_str() {
                let block = json!({"type": "tool_use", "id": tool_use_id(id),
                                   "name": call["function"]["name"], "input": {}});
                out += &self.open(block, false).0;
            }
            if let (Some(args), Some((index, false))) = (
                call["function"]["arguments"]
                    .as_str()
                    .filter(|a| !a.is_empty()),
                self.open,
            ) {
                out += &event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": args}}),
                );
            }
        }
        if let Some(finish) = choice["finish_reason"].as_str() {
            self.finish = Some(finish.to_owned());
        }
        out
    }

    fn finish(&mut self) -> String {
        if self.done {
            return String::new();
        }
        self.done = true;
        let mut out = self.start(&json!({}));
        out += &self.close();
        out += &event(
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(self.finish.as_deref()), "stop_sequence": null},
                    "usage": self.usage}),
        );
        out + &event("message_stop", &json!({"type": "message_stop"}))
    }

    fn error(&mut self, message: &str) -> String {
        self.done = true;
        event(
            "error",
            &json!({"type": "error", "error": {"type": "api_error", "message": message}}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_become_anthropic_events() {
        let mut w = ChunkWriter::new("m".into());
        let mut buffer = String::from(
            "data: {\"id\":\"c1\",\"model\":\"up\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_7\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\\\":1}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n\
             data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3}}\n\ndata: [DON",
        );
        let mut out = w.feed(&mut buffer);
        assert_eq!(buffer, "data: [DON");
        buffer.push_str("E]\n\n");
        out += &w.feed(&mut buffer);
        let kinds: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(
            kinds,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert!(out.contains("\"id\":\"toolu_7\""), "{out}");
        assert!(out.contains("\"partial_json\":\"{\\\"a\\\":1}\""), "{out}");
        assert!(out.contains("\"stop_reason\":\"tool_use\""), "{out}");
        assert!(out.contains("\"output_tokens\":3"), "{out}");
    }

    #[test]
    fn a_whole_completion_becomes_a_message() {
        let answer = json!({"id": "c1", "model": "up", "choices": [{"message": {"content": "Hi",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}});
        let m = message(&answer, "m");
        assert_eq!(m["content"][0], json!({"type": "text", "text": "Hi"}));
        assert_eq!(m["content"][1]["input"], json!({"a": 1}));
        assert_eq!(m["content"][1]["id"], "toolu_1");
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["usage"]["input_tokens"], 5);
    }
}
