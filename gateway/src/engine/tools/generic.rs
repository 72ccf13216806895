//! Tools for templates that know nothing of them (SmolLM2, Gemma 3): a
//! system prompt of mlxgate's own lists the tools and asks for the
//! [`hermes`](super::hermes) markup, and the history's calls and results
//! become plain text the template can render (results as a user turn, so
//! templates that insist on alternating roles accept them).
//!
//! The prompt, for a tool `get_weather`:
//!
//! ```text
//! You can call functions. Their signatures are inside <tools></tools>:
//! <tools>
//! {"type": "function", "function": {"name": "get_weather", ...}}
//! </tools>
//! To call functions, answer only with one JSON object per call, each between
//! <tool_call> and </tool_call>:
//! <tool_call>
//! {"name": <function-name>, "arguments": <arguments-json-object>}
//! </tool_call>
//! The results come back inside <tool_response></tool_response>; answer the user from them.
//! ```

use super::{ChatMessage, ToolUse, hermes, template_tool};
use crate::util::json::python_dumps;

/// The system prompt that describes `tools`.
pub fn system_prompt(tools: &ToolUse) -> String {
    let mut prompt = String::from(
        "You can call functions. Their signatures are inside <tools></tools>:\n<tools>",
    );
    for tool in &tools.tools {
        prompt.push('\n');
        prompt.push_str(&python_dumps(&template_tool(tool)));
    }
    prompt.push_str(
        "\n</tools>\nTo call functions, answer only with one JSON object per call, each between \
         <tool_call> and </tool_call>:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <arguments-json-object>}\n</tool_call>\n\
         The results come back inside <tool_response></tool_response>; answer the user from them.",
    );
    prompt
}

/// `messages` with the tool prompt (when the tools are active) joined to
/// the system message, calls written out in the assistant turns, and each
/// run of tool results as one user turn.
pub fn messages(messages: &[ChatMessage], tools: &ToolUse) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    if tools.active() {
        let prompt = system_prompt(tools);
        match messages.first() {
            Some(first) if first.role == "system" => {}
            _ => out.push(ChatMessage::text("system", &prompt)),
        }
    }
    for (i, m) in messages.iter().enumerate() {
        match m.role.as_str() {
            "system" if i == 0 && tools.active() => {
                let prompt = system_prompt(tools);
                out.push(ChatMessage::text(
                    "system",
                    &format!("{}\n\n{prompt}", m.content),
                ));
            }
            "assistant" if !m.tool_calls.is_empty() => {
                let mut parts: Vec<String> = Vec::new();
                if !m.content.is_empty() {
                    parts.push(m.content.clone());
                }
                parts.extend(m.tool_calls.iter().map(hermes::write_call));
                out.push(ChatMessage::text("assistant", &parts.join("\n")));
            }
            "tool" => {
                let result = format!("<tool_response>\n{}\n</tool_response>", m.content);
                match out.last_mut() {
                    Some(last) if last.role == "user" && messages[i - 1].role == "tool" => {
                        last.content.push('\n');
                        last.content.push_str(&result);
                    }
                    _ => out.push(ChatMessage::text("user", &result)),
                }
            }
            _ => out.push(ChatMessage::text(&m.role, &m.content)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::api::{Tool, ToolCall, ToolChoice};

    fn weather() -> ToolUse {
        ToolUse {
            tools: vec![Tool {
                name: "get_weather".into(),
                description: Some("Weather in a city".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            }],
            choice: ToolChoice::Auto,
            parallel: true,
        }
    }

    #[test]
    fn history_becomes_text_turns() {
        let call = ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: "{\"city\":\"Paris\"}".into(),
        };
        let history = vec![
            ChatMessage::text("user", "Weather in Paris and Rome?"),
            ChatMessage {
                tool_calls: vec![call.clone(), call],
                ..ChatMessage::text("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                ..ChatMessage::text("tool", "sunny")
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                ..ChatMessage::text("tool", "rain")
            },
        ];
        let out = messages(&history, &weather());
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(out[0].content.contains("\"name\": \"get_weather\""));
        assert_eq!(
            out[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert_eq!(
            out[3].content,
            "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        );
        // With `none` the tools are not described, the history still reads.
        let none = ToolUse {
            choice: ToolChoice::None,
            ..weather()
        };
        let out = messages(&history, &none);
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].role, "user");
    }

    #[test]
    fn the_prompt_joins_a_system_message() {
        let out = messages(&[ChatMessage::text("system", "Be brief.")], &weather());
        assert_eq!(out.len(), 1);
        assert!(
            out[0]
                .content
                .starts_with("Be brief.\n\nYou can call functions.")
        );
    }
}
