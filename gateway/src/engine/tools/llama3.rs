//! Llama 3.x tool calls: the turn is one JSON object
//! `{"name": ..., "parameters": {...}}` (several joined by `; ` when
//! parallel calls are allowed); a turn that does not begin with `{` is
//! text.

use serde_json::Value;

use super::{Tool, ToolCall, answer_rule, call_of, call_schema};

/// The Lark grammar of an output: see [`super::hermes::grammar`].
pub fn grammar(
    tools: &[&Tool],
    only_calls: bool,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    let more = if parallel { "(\"; \" call_json)*" } else { "" };
    let start = match (only_calls, answer) {
        (true, _) => "start: calls\n".to_owned(),
        (false, Some(answer)) => format!("start: answer | calls\n{}", answer_rule(answer)),
        (false, None) => {
            "start: TEXT | calls\nTEXT: /(.|\\n)*/ & ~/[ \\t\\n]*\\{(.|\\n)*/\n".to_owned()
        }
    };
    format!(
        "{start}calls: call_json {more}\ncall_json: %json {}\n",
        call_schema(tools, "parameters")
    )
}

/// The calls of a whole turn, or `None` if it is not calls.
pub fn parse_calls(output: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = output.trim_start();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        calls.push(call_of(&value, "parameters")?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}
