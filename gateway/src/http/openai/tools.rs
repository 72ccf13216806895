//! Tool calling on `/v1/chat/completions`: reading `tools`, `tool_choice`,
//! `parallel_tool_calls` and the tool turns of the history (each a 400
//! naming its field when wrong), and writing the calls of an answer
//! (`message.tool_calls`, streamed `delta.tool_calls`).

use std::collections::HashSet;

use serde::Serialize;
use serde_json::{Map, Value};

use super::engine::{ChatMessage, Tool, ToolCall, ToolChoice, ToolUse};
use super::validate::{Fields, invalid, missing, unsupported, wrong_type};
use crate::http::ApiError;

/// Most tools one request may list (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Longest tool name (OpenAI's limit).
pub const MAX_TOOL_NAME: usize = 64;

/// `tools`, `tool_choice` and `parallel_tool_calls`, checked against each
/// other: a named choice must name a listed tool.
pub(super) fn tool_use(f: &Fields) -> Result<ToolUse, ApiError> {
    let tools = read_tools(f.get("tools"), "function.name", tool)?;
    let choice = tool_choice(f.get("tool_choice"), &tools)?;
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    Ok(ToolUse {
        tools,
        choice,
        parallel,
    })
}

/// A `tools` array of any of the APIs: at most [`MAX_TOOLS`], each read by
/// `read` (given its param, `tools[i]`), names distinct (`name_at` is where
/// a tool's name sits, for the error's param).
pub(crate) fn read_tools(
    value: Option<&Value>,
    name_at: &str,
    read: impl Fn(&str, &Value) -> Result<Tool, ApiError>,
) -> Result<Vec<Tool>, ApiError> {
    let items = match value {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type("tools", "array", other)),
    };
    if items.len() > MAX_TOOLS {
        return Err(invalid(
            "tools",
            "array_above_max_length",
            &format!(
                "Invalid 'tools': array too long. Expected an array with maximum length {MAX_TOOLS}, but got an array with length {} instead.",
                items.len()
            ),
        ));
    }
    let tools: Vec<Tool> = items
        .iter()
        .enumerate()
        .map(|(i, t)| read(&format!("tools[{i}]"), t))
        .collect::<Result<_, _>>()?;
    let mut seen = HashSet::new();
    if let Some((i, t)) = tools
        .iter()
        .enumerate()
        .find(|(_, t)| !seen.insert(t.name.as_str()))
    {
        return Err(invalid(
            &format!("tools[{i}].{name_at}"),
            "invalid_value",
            &format!(
                "Invalid 'tools': the name '{}' is used twice; give each tool its own name.",
                t.name
            ),
        ));
    }
    Ok(tools)
}

/// One `{"type": "function", "function": {name, description?, parameters?, strict?}}`.
fn tool(at: &str, value: &Value) -> Result<Tool, ApiError> {
    let obj = object(at, value)?;
    match string(at, obj, "type")? {
        Some("function") => {}
        Some(other) => {
            return Err(unsupported(
                &format!("{at}.type"),
                &format!("Invalid value: '{other}'. Supported values are: 'function'."),
            ));
        }
        None => return Err(missing(&format!("{at}.type"))),
    }
    let at = format!("{at}.function");
    let function = object(&at, obj.get("function").unwrap_or(&Value::Null))?;
    let name = tool_name(&format!("{at}.name"), string(&at, function, "name")?)?;
    let description = string(&at, function, "description")?.map(str::to_owned);
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => return Err(wrong_type(&format!("{at}.parameters"), "object", other)),
    };
    if let Some(strict) = function.get("strict")
        && !strict.is_null()
        && !strict.is_boolean()
    {
        return Err(wrong_type(&format!("{at}.strict"), "boolean", strict));
    }
    Ok(Tool {
        name: name.to_owned(),
        description,
        parameters,
    })
}

/// A function name: 1 to 64 letters, digits, `_` or `-` (OpenAI's and
/// Anthropic's rule).
pub(crate) fn tool_name<'a>(param: &str, name: Option<&'a str>) -> Result<&'a str, ApiError> {
    let name = name.ok_or_else(|| missing(param))?;
    if name.is_empty()
        || name.len() > MAX_TOOL_NAME
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(invalid(
            param,
            "invalid_value",
            &format!(
                "Invalid '{param}': '{name}' is not a function name. Use 1 to {MAX_TOOL_NAME} letters, digits, underscores or dashes."
            ),
        ));
    }
    Ok(name)
}

/// `tool_choice`: `none`, `auto` (the default with tools), `required`, or
/// `{"type": "function", "function": {"name": ...}}` naming a listed tool.
fn tool_choice(value: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    const PARAM: &str = "tool_choice";
    let choice = match value {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    PARAM,
                    "invalid_value",
                    &format!(
                        "Invalid value: '{other}'. Supported values are: 'none', 'auto', 'required', or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}."
                    ),
                ));
            }
        },
        Some(v @ Value::Object(obj)) => {
            match string(PARAM, obj, "type")? {
                Some("function") => {}
                _ => {
                    return Err(invalid(
                        "tool_choice.type",
                        "invalid_value",
                        "Invalid 'tool_choice.type': expected 'function'.",
                    ));
                }
            }
            let function = object(
                "tool_choice.function",
                obj.get("function").unwrap_or(&Value::Null),
            )
            .map_err(|_| wrong_type("tool_choice.function", "object", v))?;
            let wanted = string("tool_choice.function", function, "name")?
                .ok_or_else(|| missing("tool_choice.function.name"))?;
            if !tools.iter().any(|t| t.name == wanted) {
                let listed: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
                return Err(invalid(
                    "tool_choice.function.name",
                    "invalid_value",
                    &format!(
                        "Invalid 'tool_choice': there is no tool named '{wanted}' in 'tools' (listed: {}).",
                        if listed.is_empty() {
                            "none".to_owned()
                        } else {
                            listed.join(", ")
                        }
                    ),
                ));
            }
            ToolChoice::Function(wanted.to_owned())
        }
        Some(other) => return Err(wrong_type(PARAM, "string or object", other)),
    };
    if tools.is_empty() && choice == ToolChoice::Required {
        return Err(invalid(
            PARAM,
            "invalid_value",
            "Invalid value for 'tool_choice': 'required' needs 'tools'; list the functions the model may call.",
        ));
    }
    Ok(choice)
}

/// An assistant message's `tool_calls`: `[{id, type: "function",
/// function: {name, arguments}}]`, arguments as JSON text.
pub fn tool_calls(at: &str, message: &Map<String, Value>) -> Result<Vec<ToolCall>, ApiError> {
    let param = format!("{at}.tool_calls");
    let items = match message.get("tool_calls") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type(&param, "array", other)),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let at = format!("{param}[{i}]");
            let obj = object(&at, call)?;
            let id = string(&at, obj, "id")?.ok_or_else(|| missing(&format!("{at}.id")))?;
            let fat = format!("{at}.function");
            let function = object(&fat, obj.get("function").unwrap_or(&Value::Null))?;
            let name = tool_name(&format!("{fat}.name"), string(&fat, function, "name")?)?;
            let arguments = string(&fat, function, "arguments")?.unwrap_or("{}");
            Ok(ToolCall {
                id: id.to_owned(),
                name: name.to_owned(),
                arguments: arguments.to_owned(),
            })
        })
        .collect()
}

/// A tool message's `tool_call_id` (required).
pub fn tool_call_id(at: &str, message: &Map<String, Value>) -> Result<String, ApiError> {
    string(at, message, "tool_call_id")?
        .map(str::to_owned)
        .ok_or_else(|| missing(&format!("{at}.tool_call_id")))
}

/// Every tool message answers a call an earlier assistant turn made.
pub fn check_tool_results(messages: &[ChatMessage]) -> Result<(), ApiError> {
    let mut called: HashSet<&str> = HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        called.extend(m.tool_calls.iter().map(|c| c.id.as_str()));
        if let Some(id) = &m.tool_call_id
            && !called.contains(id.as_str())
        {
            return Err(invalid(
                &format!("messages[{i}].tool_call_id"),
                "invalid_value",
                &format!(
                    "Invalid 'messages[{i}].tool_call_id': no earlier assistant message has a tool call with id '{id}'. Each 'tool' message must answer a call listed in a preceding assistant message's 'tool_calls'."
                ),
            ));
        }
    }
    Ok(())
}

pub(crate) fn object<'a>(
    param: &str,
    value: &'a Value,
) -> Result<&'a Map<String, Value>, ApiError> {
    match value {
        Value::Object(obj) => Ok(obj),
        Value::Null => Err(missing(param)),
        other => Err(wrong_type(param, "object", other)),
    }
}

/// `obj.type` (required): which kind of block, part, item or tool it is.
pub(crate) fn kind<'a>(at: &str, obj: &'a Map<String, Value>) -> Result<&'a str, ApiError> {
    string(at, obj, "type")?.ok_or_else(|| missing(&format!("{at}.type")))
}

/// `obj[key]` as a string (`null` and absent are `None`).
pub(crate) fn string<'a>(
    at: &str,
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong_type(&format!("{at}.{key}"), "string", other)),
    }
}

/// A call in a response: `message.tool_calls[i]`, or in a stream
/// `delta.tool_calls[i]` (with `index`; the first chunk of a call carries
/// `id`, `type` and the name, the next its arguments).
#[derive(Debug, Serialize, PartialEq)]
pub struct CallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionOut,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct FunctionOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

impl CallOut {
    /// The whole call, for a non-streamed answer.
    pub fn whole(call: ToolCall) -> CallOut {
        CallOut {
            index: None,
            id: Some(call.id),
            kind: Some("function"),
            function: FunctionOut {
                name: Some(call.name),
                arguments: call.arguments,
            },
        }
    }

    /// The two stream deltas of call `index`: its head, then its arguments.
    pub fn streamed(index: usize, call: ToolCall) -> [CallOut; 2] {
        [
            CallOut {
                index: Some(index),
                id: Some(call.id),
                kind: Some("function"),
                function: FunctionOut {
                    name: Some(call.name),
                    arguments: String::new(),
                },
            },
            CallOut {
                index: Some(index),
                id: None,
                kind: None,
                function: FunctionOut {
                    name: None,
                    arguments: call.arguments,
                },
            },
        ]
    }
}

/// A whole answer read for tool calls: its text (`None` when it is only
/// calls) and its calls.
pub fn read_answer(
    mut parser: crate::engine::tools::CallParser,
    text: &str,
) -> (Option<String>, Vec<ToolCall>) {
    use crate::engine::tools::Piece;
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in parser.push(text).into_iter().chain(parser.finish()) {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    let content = (!content.is_empty() || calls.is_empty()).then_some(content);
    (content, calls)
}

/// The finish reason of a choice: `tool_calls` when it ended by itself
/// after making calls.
pub fn finish_reason(reason: crate::engine::FinishReason, calls: usize) -> &'static str {
    match reason {
        reason if reason.stopped() && calls > 0 => "tool_calls",
        reason => reason.as_str(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::validate::chat_request;
    use super::super::validate::tests::{chat, rejects};
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    #[test]
    fn tools_and_choices_are_read() {
        let r = chat_request(&chat(json!({"tools": [weather()]}))).unwrap();
        assert_eq!(r.tools.choice, ToolChoice::Auto);
        assert!(r.tools.parallel && r.tools.active());
        assert_eq!(r.tools.tools[0].name, "get_weather");
        for (choice, want) in [
            (json!("none"), ToolChoice::None),
            (json!("required"), ToolChoice::Required),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                ToolChoice::Function("get_weather".into()),
            ),
        ] {
            let r = chat_request(&chat(json!({"tools": [weather()], "tool_choice": choice,
                                              "parallel_tool_calls": false})))
            .unwrap();
            assert_eq!(r.tools.choice, want);
            assert!(!r.tools.parallel);
        }
        let r = chat_request(&chat(json!({"tool_choice": "none"}))).unwrap();
        assert!(!r.tools.active());
    }

    #[test]
    fn bad_tools_name_the_field() {
        let cases = [
            (
                json!({"tools": [{"type": "retrieval"}]}),
                "tools[0].type",
                "unsupported_value",
            ),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools[0].function",
                "missing_required_parameter",
            ),
            (
                json!({"tools": [{"type": "function", "function": {}}]}),
                "tools[0].function.name",
                "missing_required_parameter",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
                "invalid_value",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
                "tools[0].function.parameters",
                "invalid_type",
            ),
            (
                json!({"tools": [weather(), weather()]}),
                "tools[1].function.name",
                "invalid_value",
            ),
            (
                json!({"tools": [weather()], "tool_choice": "always"}),
                "tool_choice",
                "invalid_value",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice.function.name",
                "invalid_value",
            ),
            (
                json!({"tool_choice": "required"}),
                "tool_choice",
                "invalid_value",
            ),
            (
                json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
                "parallel_tool_calls",
                "invalid_type",
            ),
        ];
        for (body, param, code) in cases {
            rejects(chat_request(&chat(body)), param, code);
        }
        let many: Vec<Value> = (0..=MAX_TOOLS)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        rejects(
            chat_request(&chat(json!({"tools": many}))),
            "tools",
            "array_above_max_length",
        );
    }

    #[test]
    fn tool_results_must_answer_an_earlier_call() {
        let call = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]});
        let ok = chat_request(&chat(json!({"messages": [
            {"role": "user", "content": "weather?"}, call,
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})))
        .unwrap();
        assert_eq!(
            ok.messages[1].tool_calls[0].arguments,
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(ok.messages[2].tool_call_id.as_deref(), Some("call_1"));
        rejects(
            chat_request(&chat(json!({"messages": [
                {"role": "user", "content": "weather?"}, call,
                {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]}))),
            "messages[2].tool_call_id",
            "invalid_value",
        );
        rejects(
            chat_request(&chat(json!({"messages": [
                {"role": "user", "content": "weather?"},
                {"role": "tool", "content": "sunny"}]}))),
            "messages[1].tool_call_id",
            "missing_required_parameter",
        );
    }
}
