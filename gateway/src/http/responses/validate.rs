//! Reading a `POST /v1/responses` body: `input` (a string, or message,
//! `function_call` and `function_call_output` items) into chat messages,
//! `instructions`, flat function `tools`, `tool_choice`, `text.format`
//! into the same grammar as `response_format`, and the sampling fields.
//! Every mistake is a 400 naming the field.

use std::collections::HashSet;

use serde_json::{Map, Value};

use crate::engine::{ChatMessage, Grammar, SamplingParams, Tool, ToolCall, ToolChoice, ToolUse};
use crate::http::ApiError;
use crate::http::openai::tools::{kind, object, read_tools, string, tool_name};
use crate::http::openai::validate::{
    Common, Endpoint, Fields, RoutingFields, adapter, basic_sampling, invalid, json_schema_spec,
    missing, prompt_cache, read_routing, unsupported, wrong_type,
};

/// A validated Responses request.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    pub common: Common,
    /// `instructions`, a system message before everything (not carried to
    /// the next response).
    pub instructions: Option<String>,
    /// The new turn's items, as messages.
    pub input: Vec<ChatMessage>,
    pub previous_response_id: Option<String>,
    pub tools: ToolUse,
    /// Keep the response for `previous_response_id` and `GET` (default on).
    pub store: bool,
}

pub fn responses_request(body: &Value) -> Result<ResponsesRequest, ApiError> {
    let f = Fields::of(body)?;
    let RoutingFields {
        model,
        max_tokens,
        stream,
        tools,
        format,
        n: _,
        features,
    } = read_routing(&f, Endpoint::Responses)?;
    let sampling = SamplingParams {
        seed: f.int_in("seed", 0, u64::MAX >> 1)?,
        ..basic_sampling(&f, 2.0)?
    };
    for field in ["reasoning", "background", "conversation", "prompt"] {
        if f.get(field)
            .is_some_and(|v| v != &Value::Object(Default::default()))
        {
            return Err(unsupported(
                field,
                &format!("'{field}' is not supported by this server; leave it out."),
            ));
        }
    }
    let previous_response_id = f.string("previous_response_id")?.map(str::to_owned);
    Ok(ResponsesRequest {
        common: Common {
            model: model.to_owned(),
            sampling,
            max_tokens,
            stop: Vec::new(),
            stream,
            include_usage: false,
            logprobs: None,
            prompt_cache: prompt_cache(&f)?,
            adapter: adapter(&f)?,
            grammar: format,
            n: 1,
            features,
        },
        instructions: f.string("instructions")?.map(str::to_owned),
        input: input(&f)?,
        previous_response_id,
        tools,
        store: f.bool("store")?.unwrap_or(true),
    })
}

/// `text.format`: `text` (none), `json_object`, or `json_schema` with
/// `name`, `schema`, `strict` beside `type`.
pub(crate) fn text_format(f: &Fields) -> Result<Option<Grammar>, ApiError> {
    let Some(text) = f.get("text") else {
        return Ok(None);
    };
    let text = object("text", text)?;
    let Some(format) = text.get("format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let obj = object("text.format", format)?;
    match string("text.format", obj, "type")? {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => json_schema_spec(Some(format), "text.format").map(Some),
        Some(other) => Err(invalid(
            "text.format.type",
            "invalid_value",
            &format!(
                "Invalid value: '{other}'. Supported values are: 'text', 'json_object' and 'json_schema'."
            ),
        )),
        None => Err(missing("text.format.type")),
    }
}

/// `input`: a string (one user message) or items. Calls join the
/// assistant turn before them; each output answers a call made earlier in
/// this input (calls of a previous response are checked when it is read).
fn input(f: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match f.get("input") {
        None => return Err(missing("input")),
        Some(Value::String(s)) => return Ok(vec![ChatMessage::text("user", s)]),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type("input", "string or array", other)),
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let obj = object(&at, item)?;
        match string(&at, obj, "type")? {
            None | Some("message") => out.push(message(&at, obj)?),
            Some("function_call") => {
                let call = function_call(&at, obj)?;
                match out.last_mut() {
                    Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                    _ => out.push(ChatMessage {
                        tool_calls: vec![call],
                        ..ChatMessage::text("assistant", "")
                    }),
                }
            }
            Some("function_call_output") => {
                let id = string(&at, obj, "call_id")?
                    .ok_or_else(|| missing(&format!("{at}.call_id")))?;
                let output = texts(&format!("{at}.output"), obj.get("output"))?;
                out.push(ChatMessage {
                    tool_call_id: Some(id.to_owned()),
                    ..ChatMessage::text("tool", &output)
                });
            }
            // Reasoning summaries of other servers' models: nothing to render.
            Some("reasoning") => {}
            Some(other) => {
                return Err(unsupported(
                    &format!("{at}.type"),
                    &format!(
                        "Items of type '{other}' are not supported; send 'message', 'function_call' and 'function_call_output' items."
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// A message item: `{role, content}` (a string or text parts).
fn message(at: &str, obj: &Map<String, Value>) -> Result<ChatMessage, ApiError> {
    let role = match string(at, obj, "role")? {
        Some("system" | "developer") => "system",
        Some(r @ ("user" | "assistant")) => r,
        Some(other) => {
            return Err(invalid(
                &format!("{at}.role"),
                "invalid_value",
                &format!(
                    "Invalid value: '{other}'. Supported values are: 'user', 'assistant', 'system' and 'developer'."
                ),
            ));
        }
        None => return Err(missing(&format!("{at}.role"))),
    };
    let content = texts(&format!("{at}.content"), obj.get("content"))?;
    Ok(ChatMessage::text(role, &content))
}

/// A `function_call` item: `{call_id, name, arguments}`.
fn function_call(at: &str, obj: &Map<String, Value>) -> Result<ToolCall, ApiError> {
    let field = |key: &str| -> Result<String, ApiError> {
        string(at, obj, key)?
            .map(str::to_owned)
            .ok_or_else(|| missing(&format!("{at}.{key}")))
    };
    Ok(ToolCall {
        id: field("call_id")?,
        name: field("name")?,
        arguments: field("arguments")?,
    })
}

/// A string, or text parts joined by newlines (`param` names it).
fn texts(param: &str, value: Option<&Value>) -> Result<String, ApiError> {
    match value {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .enumerate()
            .map(|(j, p)| part(&format!("{param}[{j}]"), p))
            .collect::<Result<Vec<_>, _>>()?
            .join("\n")),
        None | Some(Value::Null) => Err(missing(param)),
        Some(other) => Err(wrong_type(param, "string or array", other)),
    }
}

/// The text of a content part (`input_text`, `output_text`, `text`).
fn part(at: &str, value: &Value) -> Result<String, ApiError> {
    let obj = object(at, value)?;
    match string(at, obj, "type")? {
        Some("input_text" | "output_text" | "text") => string(at, obj, "text")?
            .map(str::to_owned)
            .ok_or_else(|| missing(&format!("{at}.text"))),
        Some(other) => Err(unsupported(
            &format!("{at}.type"),
            &format!(
                "Content of type '{other}' is not supported: this server serves text-only models; send 'input_text' parts."
            ),
        )),
        None => Err(missing(&format!("{at}.type"))),
    }
}

/// Every `tool` message answers a call made before it in `messages`.
pub fn check_outputs(messages: &[ChatMessage]) -> Result<(), ApiError> {
    let mut called: HashSet<&str> = HashSet::new();
    for m in messages {
        called.extend(m.tool_calls.iter().map(|c| c.id.as_str()));
        if let Some(id) = &m.tool_call_id
            && !called.contains(id.as_str())
        {
            return Err(invalid(
                "input",
                "invalid_value",
                &format!("No tool call found for function call output with call_id {id}."),
            ));
        }
    }
    Ok(())
}

/// `tools` (`{"type": "function", name, description?, parameters?,
/// strict?}`; built-in tools are refused), `tool_choice` (`none`, `auto`,
/// `required`, `{"type": "function", "name"}`), `parallel_tool_calls`.
pub(crate) fn tool_use(f: &Fields) -> Result<ToolUse, ApiError> {
    let tools = read_tools(f.get("tools"), "name", tool)?;
    let choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    "invalid_value",
                    &format!(
                        "Invalid value: '{other}'. Supported values are: 'none', 'auto', 'required', or {{\"type\": \"function\", \"name\": ...}}."
                    ),
                ));
            }
        },
        Some(v) => {
            let obj = object("tool_choice", v)?;
            if string("tool_choice", obj, "type")? != Some("function") {
                return Err(unsupported(
                    "tool_choice.type",
                    "Only function tools can be chosen: {\"type\": \"function\", \"name\": ...}.",
                ));
            }
            let name =
                string("tool_choice", obj, "name")?.ok_or_else(|| missing("tool_choice.name"))?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(invalid(
                    "tool_choice.name",
                    "invalid_value",
                    &format!("Invalid 'tool_choice': there is no tool named '{name}' in 'tools'."),
                ));
            }
            ToolChoice::Function(name.to_owned())
        }
    };
    if tools.is_empty() && choice == ToolChoice::Required {
        return Err(invalid(
            "tool_choice",
            "invalid_value",
            "Invalid value for 'tool_choice': 'required' needs 'tools'.",
        ));
    }
    Ok(ToolUse {
        tools,
        choice,
        parallel: f.bool("parallel_tool_calls")?.unwrap_or(true),
    })
}

fn tool(at: &str, value: &Value) -> Result<Tool, ApiError> {
    let obj = object(at, value)?;
    match kind(at, obj)? {
        "function" => {}
        other => {
            return Err(unsupported(
                &format!("{at}.type"),
                &format!("Tools of type '{other}' are not supported; send function tools."),
            ));
        }
    }
    let name = tool_name(&format!("{at}.name"), string(at, obj, "name")?)?;
    let parameters = match obj.get("parameters") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => return Err(wrong_type(&format!("{at}.parameters"), "object", other)),
    };
    Ok(Tool {
        name: name.to_owned(),
        description: string(at, obj, "description")?.map(str::to_owned),
        parameters,
    })
}
