//! Reading a `POST /v1/messages` body into the request the chat endpoint
//! serves: `system` and `messages` (text, `tool_use` and `tool_result`
//! blocks) become chat messages, `tools` / `tool_choice` the same tool use,
//! the sampling fields the same settings. Every mistake is a 400 naming the
//! field (in Anthropic's error shape: see `super::error_response`).

use std::collections::HashSet;

use serde_json::{Map, Value};

use crate::engine::{ChatMessage, Grammar, SamplingParams, Tool, ToolCall, ToolChoice, ToolUse};
use crate::http::ApiError;
use crate::http::openai::tools::{kind, object, read_tools, string, tool_name};
use crate::http::openai::validate::{
    Common, Endpoint, Fields, MAX_STOP, MAX_STOP_BYTES, RoutingFields, adapter, basic_sampling,
    invalid, missing, prompt_cache, read_routing, unsupported, wrong_type,
};

/// A validated Messages request.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagesRequest {
    pub common: Common,
    pub messages: Vec<ChatMessage>,
    pub tools: ToolUse,
}

/// `POST /v1/messages`; `count_only` for `/v1/messages/count_tokens`,
/// which needs no `max_tokens`.
pub fn messages_request(body: &Value, count_only: bool) -> Result<MessagesRequest, ApiError> {
    let f = Fields::of(body)?;
    let RoutingFields {
        model,
        max_tokens,
        stream,
        tools,
        format,
        n: _,
        features,
    } = read_routing(&f, Endpoint::Messages)?;
    if max_tokens.is_none() && !count_only {
        return Err(missing("max_tokens"));
    }
    let mut messages = system(&f)?;
    messages.extend(turns(&f)?);
    let sampling = SamplingParams {
        top_k: f.int_in("top_k", 0, u32::MAX as u64)?.unwrap_or(0) as usize,
        ..basic_sampling(&f, 1.0)?
    };
    if let Some(thinking) = f.get("thinking")
        && thinking.get("type").and_then(Value::as_str) != Some("disabled")
    {
        return Err(unsupported(
            "thinking",
            "Extended thinking is not supported by this server; leave 'thinking' out.",
        ));
    }
    if let Some(metadata) = f.get("metadata")
        && !metadata.is_object()
    {
        return Err(wrong_type("metadata", "object", metadata));
    }
    Ok(MessagesRequest {
        common: Common {
            model: model.to_owned(),
            sampling,
            max_tokens,
            stop: stop_sequences(&f)?,
            stream,
            include_usage: false,
            logprobs: None,
            prompt_cache: prompt_cache(&f)?,
            adapter: adapter(&f)?,
            grammar: format,
            n: 1,
            features,
        },
        messages,
        tools,
    })
}

/// `output_config.format`: `{"type": "json_schema", "schema": {...}}`
/// (what the SDK's `messages.parse(output_format=...)` sends), enforced by
/// the same constrained decoding as OpenAI's `response_format`; `effort`
/// is accepted and has no effect here.
pub(crate) fn output_format(f: &Fields) -> Result<Option<Grammar>, ApiError> {
    let Some(config) = f.get("output_config") else {
        return Ok(None);
    };
    let config = object("output_config", config)?;
    let Some(format) = config.get("format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let format = object("output_config.format", format)?;
    match kind("output_config.format", format)? {
        "json_schema" => match format.get("schema") {
            Some(schema @ Value::Object(_)) => Ok(Some(Grammar::JsonSchema(schema.clone()))),
            None | Some(Value::Null) => Err(missing("output_config.format.schema")),
            Some(other) => Err(wrong_type("output_config.format.schema", "object", other)),
        },
        other => Err(invalid(
            "output_config.format.type",
            "invalid_value",
            &format!("output_config.format.type: Input should be 'json_schema', not '{other}'."),
        )),
    }
}

/// `system`: a string or text blocks, as the first message.
fn system(f: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    Ok(match f.get("system") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![ChatMessage::text("system", s)],
        Some(Value::Array(blocks)) => {
            let text = blocks
                .iter()
                .enumerate()
                .map(|(i, b)| text_block(&format!("system[{i}]"), b))
                .collect::<Result<Vec<_>, _>>()?;
            vec![ChatMessage::text("system", &text.join("\n"))]
        }
        Some(other) => return Err(wrong_type("system", "string or array", other)),
    })
}

/// The text of a `{"type": "text", "text": ...}` block.
fn text_block<'a>(at: &str, block: &'a Value) -> Result<&'a str, ApiError> {
    let obj = object(at, block)?;
    match kind(at, obj)? {
        "text" => {}
        other => {
            return Err(unsupported(
                &format!("{at}.type"),
                &format!("Unsupported block type '{other}' here: only 'text' blocks are accepted."),
            ));
        }
    }
    string(at, obj, "text")?.ok_or_else(|| missing(&format!("{at}.text")))
}

/// `messages`: user and assistant turns. A user turn's `tool_result`
/// blocks become `tool` messages (before its text); an assistant turn's
/// `tool_use` blocks become its tool calls. Every result answers an
/// earlier call.
fn turns(f: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    let v = f.get("messages").ok_or_else(|| missing("messages"))?;
    let Value::Array(items) = v else {
        return Err(wrong_type("messages", "array", v));
    };
    if items.is_empty() {
        return Err(invalid(
            "messages",
            "invalid_value",
            "messages: at least one message is required.",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    let mut called: HashSet<String> = HashSet::new();
    for (i, item) in items.iter().enumerate() {
        turn(&format!("messages[{i}]"), item, &mut called, &mut out)?;
    }
    Ok(out)
}

/// One turn onto `out`: its tool results as `tool` messages, then its
/// text (and calls); `called` collects the ids of calls made so far.
fn turn(
    at: &str,
    item: &Value,
    called: &mut HashSet<String>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let obj = object(at, item)?;
    let role = match string(at, obj, "role")? {
        Some(r @ ("user" | "assistant")) => r,
        Some(other) => {
            return Err(invalid(
                &format!("{at}.role"),
                "invalid_value",
                &format!("{at}.role: Input should be 'user' or 'assistant', not '{other}'."),
            ));
        }
        None => return Err(missing(&format!("{at}.role"))),
    };
    let blocks: Vec<Value> = match obj.get("content") {
        Some(Value::String(s)) => vec![serde_json::json!({"type": "text", "text": s})],
        Some(Value::Array(blocks)) => blocks.clone(),
        None | Some(Value::Null) => return Err(missing(&format!("{at}.content"))),
        Some(other) => {
            return Err(wrong_type(
                &format!("{at}.content"),
                "string or array",
                other,
            ));
        }
    };
    let mut text = Vec::new();
    let mut calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let bat = format!("{at}.content[{j}]");
        let b = object(&bat, block)?;
        match (role, kind(&bat, b)?) {
            (_, "text") => text.push(text_block(&bat, block)?.to_owned()),
            ("assistant", "tool_use") => {
                let call = tool_use_call(&bat, b)?;
                called.insert(call.id.clone());
                calls.push(call);
            }
            ("user", "tool_result") => out.push(tool_result(&bat, b, called)?),
            (_, other) => {
                return Err(unsupported(
                    &format!("{bat}.type"),
                    &format!(
                        "{bat}.type: '{other}' blocks are not supported in a {role} message. This server takes 'text' blocks, 'tool_use' blocks from the assistant and 'tool_result' blocks from the user (no images, documents or thinking)."
                    ),
                ));
            }
        }
    }
    if role == "user" && text.is_empty() && out.last().is_some_and(|m| m.role == "tool") {
        return Ok(());
    }
    out.push(ChatMessage {
        tool_calls: calls,
        ..ChatMessage::text(role, &text.join("\n"))
    });
    Ok(())
}

/// A `tool_use` block: `{id, name, input}`.
fn tool_use_call(at: &str, b: &Map<String, Value>) -> Result<ToolCall, ApiError> {
    let id = string(at, b, "id")?.ok_or_else(|| missing(&format!("{at}.id")))?;
    let name = string(at, b, "name")?.ok_or_else(|| missing(&format!("{at}.name")))?;
    let arguments = match b.get("input") {
        Some(input @ Value::Object(_)) => input.to_string(),
        None | Some(Value::Null) => "{}".to_owned(),
        Some(other) => return Err(wrong_type(&format!("{at}.input"), "object", other)),
    };
    Ok(ToolCall {
        id: id.to_owned(),
        name: name.to_owned(),
        arguments,
    })
}

/// A `tool_result` block (`{tool_use_id, content}`) as a `tool` message;
/// it must answer a call in `called`.
fn tool_result(
    at: &str,
    b: &Map<String, Value>,
    called: &HashSet<String>,
) -> Result<ChatMessage, ApiError> {
    let id = string(at, b, "tool_use_id")?.ok_or_else(|| missing(&format!("{at}.tool_use_id")))?;
    if !called.contains(id) {
        return Err(invalid(
            &format!("{at}.tool_use_id"),
            "invalid_value",
            &format!(
                "{at}.tool_use_id: no earlier assistant message has a tool_use block with id '{id}'. Each tool_result must answer a tool_use of a preceding assistant turn."
            ),
        ));
    }
    let content = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(k, p)| text_block(&format!("{at}.content[{k}]"), p))
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        Some(other) => {
            return Err(wrong_type(
                &format!("{at}.content"),
                "string or array",
                other,
            ));
        }
    };
    Ok(ChatMessage {
        tool_call_id: Some(id.to_owned()),
        ..ChatMessage::text("tool", &content)
    })
}

/// `stop_sequences`: up to [`MAX_STOP`] strings.
fn stop_sequences(f: &Fields) -> Result<Vec<String>, ApiError> {
    let items = match f.get("stop_sequences") {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type("stop_sequences", "array", other)),
    };
    if items.len() > MAX_STOP {
        return Err(invalid(
            "stop_sequences",
            "invalid_value",
            &format!(
                "stop_sequences: at most {MAX_STOP} sequences are supported, got {}.",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            Value::String(s) if s.len() <= MAX_STOP_BYTES => Ok(s.clone()),
            Value::String(_) => Err(invalid(
                &format!("stop_sequences[{i}]"),
                "invalid_value",
                &format!("stop_sequences[{i}]: at most {MAX_STOP_BYTES} bytes."),
            )),
            other => Err(wrong_type(&format!("stop_sequences[{i}]"), "string", other)),
        })
        .filter(|s| !matches!(s, Ok(s) if s.is_empty()))
        .collect()
}

/// `tools` (`{name, description?, input_schema}`; server tools such as web
/// search are refused) and `tool_choice` (`auto`, `any`, `tool` with a
/// name, `none`; `disable_parallel_tool_use`).
pub(crate) fn tool_use(f: &Fields) -> Result<ToolUse, ApiError> {
    let tools = read_tools(f.get("tools"), "name", tool)?;
    let (choice, parallel) = match f.get("tool_choice") {
        None => (ToolChoice::Auto, true),
        Some(v) => {
            let obj = object("tool_choice", v)?;
            let parallel = match obj.get("disable_parallel_tool_use") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => !b,
                Some(other) => {
                    return Err(wrong_type(
                        "tool_choice.disable_parallel_tool_use",
                        "boolean",
                        other,
                    ));
                }
            };
            let choice = match string("tool_choice", obj, "type")? {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => {
                    let name = string("tool_choice", obj, "name")?
                        .ok_or_else(|| missing("tool_choice.name"))?;
                    if !tools.iter().any(|t| t.name == name) {
                        return Err(invalid(
                            "tool_choice.name",
                            "invalid_value",
                            &format!(
                                "tool_choice.name: there is no tool named '{name}' in 'tools'."
                            ),
                        ));
                    }
                    ToolChoice::Function(name.to_owned())
                }
                Some(other) => {
                    return Err(invalid(
                        "tool_choice.type",
                        "invalid_value",
                        &format!(
                            "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none', not '{other}'."
                        ),
                    ));
                }
                None => return Err(missing("tool_choice.type")),
            };
            (choice, parallel)
        }
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(invalid(
            "tool_choice",
            "invalid_value",
            "tool_choice: 'any' and 'tool' need 'tools'; list the tools the model may use.",
        ));
    }
    Ok(ToolUse {
        tools,
        choice,
        parallel,
    })
}

fn tool(at: &str, value: &Value) -> Result<Tool, ApiError> {
    let obj = object(at, value)?;
    match string(at, obj, "type")? {
        None | Some("custom") => {}
        Some(other) => {
            return Err(unsupported(
                &format!("{at}.type"),
                &format!(
                    "{at}.type: server tools such as '{other}' are not supported; give client tools ({{name, description, input_schema}})."
                ),
            ));
        }
    }
    let name = tool_name(&format!("{at}.name"), string(at, obj, "name")?)?;
    let parameters = match obj.get("input_schema") {
        Some(schema @ Value::Object(_)) => schema.clone(),
        None | Some(Value::Null) => return Err(missing(&format!("{at}.input_schema"))),
        Some(other) => return Err(wrong_type(&format!("{at}.input_schema"), "object", other)),
    };
    Ok(Tool {
        name: name.to_owned(),
        description: string(at, obj, "description")?.map(str::to_owned),
        parameters,
    })
}
