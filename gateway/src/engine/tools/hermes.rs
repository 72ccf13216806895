//! The `<tool_call>` markup of Qwen 2.5 and Hermes-style templates (and of
//! mlxgate's generic tool prompt): each call is a JSON object
//! `{"name": ..., "arguments": {...}}` on its own line between
//! `<tool_call>` and `</tool_call>`.

use serde_json::Value;

use super::{Tool, ToolCall, answer_rule, call_of, call_schema};

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

/// The Lark grammar of an output: calls only (`only_calls`), or free text
/// (or the `answer` JSON) as an alternative to calls; one call, or several
/// when `parallel`.
pub fn grammar(
    tools: &[&Tool],
    only_calls: bool,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    let more = if parallel {
        "(\"\\n<tool_call>\" call)*"
    } else {
        ""
    };
    let start = match (only_calls, answer) {
        (true, _) => "start: \"<tool_call>\" call more\n".to_owned(),
        (false, Some(answer)) => format!(
            "start: answer | \"<tool_call>\" call more\n{}",
            answer_rule(answer)
        ),
        // Text that never writes the tag, or text up to the first tag
        // (the lazy rule ends at it) and then calls.
        (false, None) => "start: TEXT | lead call more\n\
             TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n\
             lead[lazy]: /(.|\\n)*<tool_call>/\n"
            .to_owned(),
    };
    format!(
        "{start}call: \"\\n\" call_json \"\\n</tool_call>\"\nmore: {more}\ncall_json: %json {}\n",
        call_schema(tools, "arguments")
    )
}

/// One call's body (between the tags), or `None` if it is not a call.
pub fn parse_call(body: &str) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(body.trim()).ok()?;
    call_of(&value, "arguments")
}

/// A call as this markup writes it, for the history of the generic prompt.
pub fn write_call(call: &ToolCall) -> String {
    let arguments = serde_json::from_str::<Value>(&call.arguments)
        .unwrap_or_else(|_| Value::String(call.arguments.clone()));
    let body = serde_json::json!({"name": call.name, "arguments": arguments});
    format!(
        "{OPEN}\n{}\n{CLOSE}",
        crate::util::json::python_dumps(&body)
    )
}
