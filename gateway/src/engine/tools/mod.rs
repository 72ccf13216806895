//! Tool calling: how a request's tools reach the model, how its calls are
//! constrained, and how they are read back out of the text it writes.
//!
//! Each model family has its own markup, one module per format, chosen
//! from the model's chat template ([`ToolFormat::of_template`]):
//! * [`hermes`]: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
//!   (Qwen 2.5 and Hermes-style templates, which render the tools
//!   themselves);
//! * [`llama3`]: a bare `{"name": ..., "parameters": ...}` object (Llama 3.x
//!   templates, which render the tools themselves);
//! * [`generic`]: templates that know nothing of tools (SmolLM2, Gemma 3):
//!   mlxgate describes the tools in a system prompt of its own and asks for
//!   the `<tool_call>` markup; calls and results in the history become
//!   plain text.
//!
//! Calls are always constrained: `required` and a named tool allow only
//! calls, `auto` allows text or calls, and once a call starts its JSON
//! must match the tool's parameters schema ([`grammar`]). The parser
//! ([`CallParser`]) reads the output as it streams.

pub mod generic;
pub mod hermes;
pub mod llama3;

use serde_json::{Value, json};

use super::api::{ChatMessage, Grammar, Tool, ToolCall, ToolChoice, ToolUse};
use super::constrain::json_options;

/// A model family's tool-call markup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Generic,
}

impl ToolFormat {
    /// The format a chat template speaks: one that writes `<tool_call>`
    /// is Hermes-style, one that writes Llama 3's `<|python_tag|>` or asks
    /// for `"parameters"` JSON is Llama 3, anything else gets the generic
    /// prompt.
    pub fn of_template(template: Option<&str>) -> ToolFormat {
        let Some(template) = template else {
            return ToolFormat::Generic;
        };
        if !template.contains("tools") {
            return ToolFormat::Generic;
        }
        if template.contains(hermes::OPEN) {
            ToolFormat::Hermes
        } else if template.contains("<|python_tag|>") || template.contains("\"parameters\"") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Generic
        }
    }
}

/// What the chat template renders for a request with tools.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPrompt {
    pub messages: Vec<ChatMessage>,
    /// The template's `tools` variable (empty: none).
    pub tools: Vec<Value>,
}

/// The messages and `tools` the template sees. Native formats get the
/// tools as the template's `tools` (unless `tool_choice` is `none`, which
/// leaves them out); the generic format folds tools, calls and results
/// into plain text.
pub fn prompt(format: ToolFormat, messages: &[ChatMessage], tools: &ToolUse) -> ToolPrompt {
    match format {
        ToolFormat::Hermes | ToolFormat::Llama3 => ToolPrompt {
            messages: messages.to_vec(),
            tools: if tools.active() {
                tools.tools.iter().map(template_tool).collect()
            } else {
                Vec::new()
            },
        },
        ToolFormat::Generic => ToolPrompt {
            messages: generic::messages(messages, tools),
            tools: Vec::new(),
        },
    }
}

/// A tool as chat templates expect it (OpenAI's `{"type": "function",
/// "function": {...}}`).
fn template_tool(tool: &Tool) -> Value {
    let mut function = serde_json::Map::new();
    function.insert("name".into(), json!(tool.name));
    if let Some(description) = &tool.description {
        function.insert("description".into(), json!(description));
    }
    function.insert("parameters".into(), tool.parameters.clone());
    json!({"type": "function", "function": function})
}

/// The grammar a request's output must match, given its tools and its
/// `response_format` (`answer`), or `None` when nothing constrains it.
/// With `auto`, the answer is the format's JSON when one is asked for,
/// else free text; regex and Lark formats cannot be combined with tools.
pub fn grammar(
    format: ToolFormat,
    tools: &ToolUse,
    answer: Option<&Grammar>,
) -> Result<Option<Grammar>, String> {
    if !tools.active() {
        return Ok(answer.cloned());
    }
    let callable: Vec<&Tool> = match &tools.choice {
        ToolChoice::Function(name) => tools.tools.iter().filter(|t| &t.name == name).collect(),
        _ => tools.tools.iter().collect(),
    };
    let answer = match (&tools.choice, answer) {
        (ToolChoice::Auto, Some(Grammar::JsonSchema(schema))) => Some(schema.clone()),
        (ToolChoice::Auto, Some(Grammar::JsonObject)) => Some(json!({"type": "object"})),
        (ToolChoice::Auto, Some(_)) => {
            return Err(
                "a regex or Lark response_format cannot be combined with tools; use a JSON schema or tool_choice 'none'"
                    .into(),
            );
        }
        _ => None,
    };
    let only_calls = matches!(tools.choice, ToolChoice::Required | ToolChoice::Function(_));
    // A named tool is called once.
    let parallel = tools.parallel && !matches!(tools.choice, ToolChoice::Function(_));
    let lark = match format {
        ToolFormat::Hermes | ToolFormat::Generic => {
            hermes::grammar(&callable, only_calls, parallel, answer.as_ref())
        }
        ToolFormat::Llama3 => llama3::grammar(&callable, only_calls, parallel, answer.as_ref()),
    };
    Ok(Some(Grammar::ToolCalls(lark)))
}

/// The `%json` schema of one call: `{name_key: <one tool's name>,
/// args_key: <its parameters>}`, keys in that order, laid out as Python's
/// `json.dumps` does (which the templates use to show calls to the model).
fn call_schema(tools: &[&Tool], args_key: &str) -> String {
    let one = |tool: &&Tool| {
        json!({
            "type": "object",
            "properties": {"name": {"const": tool.name}, args_key: parameters(tool)},
            "required": ["name", args_key],
            "additionalProperties": false,
        })
    };
    let schema = match tools {
        [tool] => one(tool),
        _ => json!({"anyOf": tools.iter().map(one).collect::<Vec<_>>()}),
    };
    json_options(&schema).to_string()
}

/// A tool's parameters schema, `{"type": "object"}` when it gives none.
fn parameters(tool: &Tool) -> Value {
    match &tool.parameters {
        Value::Object(map) if map.is_empty() => json!({"type": "object"}),
        other => other.clone(),
    }
}

/// The Lark rule `answer` of an `auto` answer given as JSON, in Python's
/// layout unless the schema sets its own.
fn answer_rule(schema: &Value) -> String {
    format!("answer: %json {}\n", json_options(schema))
}

/// A piece of a model's output: text for `content`, or one whole call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Reads tool calls out of a model's output as it streams in: text that
/// cannot be part of a call goes out at once; a call goes out whole when
/// its markup closes. Whitespace around calls is dropped.
#[derive(Debug)]
pub struct CallParser {
    format: ToolFormat,
    /// Text held back: a possible start of a call, whitespace, or a call
    /// in progress.
    held: String,
    in_call: bool,
    /// Llama 3: whether the output is calls (it began with `{`).
    json_output: Option<bool>,
    calls: usize,
}

impl CallParser {
    pub fn new(format: ToolFormat) -> CallParser {
        CallParser {
            format,
            held: String::new(),
            in_call: false,
            json_output: None,
            calls: 0,
        }
    }

    /// How many calls have gone out.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The pieces `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        match self.format {
            ToolFormat::Hermes | ToolFormat::Generic => self.hermes(&mut out),
            ToolFormat::Llama3 => self.llama3(&mut out, false),
        }
        self.count(&out);
        out
    }

    /// What is left once the output ends: held text, or a call cut short
    /// (by `max_tokens`), which goes out as text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.format {
            ToolFormat::Hermes | ToolFormat::Generic => {
                self.hermes(&mut out);
                let held = std::mem::take(&mut self.held);
                // A call cut short after whole ones is dropped (the finish
                // reason says the output was cut); alone, it is the answer.
                if self.in_call {
                    if self.calls == 0 {
                        out.push(Piece::Text(format!("{}{held}", hermes::OPEN)));
                    }
                } else if self.calls == 0 || !held.trim().is_empty() {
                    self.text(&mut out, held);
                }
            }
            ToolFormat::Llama3 => self.llama3(&mut out, true),
        }
        self.count(&out);
        out
    }

    fn count(&mut self, out: &[Piece]) {
        self.calls += out.iter().filter(|p| matches!(p, Piece::Call(_))).count();
    }

    fn text(&self, out: &mut Vec<Piece>, text: String) {
        if !text.is_empty() {
            out.push(Piece::Text(text));
        }
    }

    fn hermes(&mut self, out: &mut Vec<Piece>) {
        loop {
            if self.in_call {
                let Some(end) = self.held.find(hermes::CLOSE) else {
                    return;
                };
                let body = self.held[..end].to_owned();
                self.held.drain(..end + hermes::CLOSE.len());
                self.in_call = false;
                match hermes::parse_call(&body) {
                    Some(call) => out.push(Piece::Call(call)),
                    None => out.push(Piece::Text(format!(
                        "{}{body}{}",
                        hermes::OPEN,
                        hermes::CLOSE
                    ))),
                }
                continue;
            }
            if let Some(start) = self.held.find(hermes::OPEN) {
                let before: String = self.held.drain(..start).collect();
                self.held.drain(..hermes::OPEN.len());
                self.text(out, before.trim_end().to_owned());
                self.in_call = true;
                continue;
            }
            // Hold what may begin the opening tag, and trailing whitespace
            // (it is dropped if a call follows).
            let keep = partial_suffix(&self.held, hermes::OPEN);
            let body = &self.held[..self.held.len() - keep];
            let trimmed = body.trim_end().len();
            if trimmed > 0 {
                let text: String = self.held.drain(..trimmed).collect();
                self.text(out, text);
            }
            return;
        }
    }

    fn llama3(&mut self, out: &mut Vec<Piece>, done: bool) {
        if self.json_output.is_none() {
            match self.held.trim_start().chars().next() {
                Some(c) => self.json_output = Some(c == '{'),
                None if done => self.json_output = Some(false),
                None => return,
            }
        }
        if self.json_output == Some(false) {
            let text = std::mem::take(&mut self.held);
            self.text(out, text);
            return;
        }
        if !done {
            return;
        }
        let held = std::mem::take(&mut self.held);
        match llama3::parse_calls(&held) {
            Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
            None => self.text(out, held),
        }
    }
}

/// `text` in pieces: read by `parser` when the request has tools, else
/// all of it text.
pub fn pieces(parser: Option<&mut CallParser>, text: String) -> Vec<Piece> {
    match parser {
        Some(parser) => parser.push(&text),
        None => vec![Piece::Text(text)],
    }
}

/// What `parser` still holds when the output ends (nothing without one).
pub fn rest(parser: Option<&mut CallParser>) -> Vec<Piece> {
    parser.map(CallParser::finish).unwrap_or_default()
}

/// The length of the longest end of `text` that begins `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// A fresh call id, in OpenAI's style (`call_` and 24 letters or digits).
pub fn call_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect();
    format!("call_{tail}")
}

/// A call read from the model's JSON: `name` and an arguments object
/// (kept as compact JSON text).
fn call_of(value: &Value, args_key: &str) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?;
    let arguments = match value.get(args_key).or_else(|| value.get("arguments")) {
        Some(args @ Value::Object(_)) => args.to_string(),
        // A model may spell the arguments as a JSON string.
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(args @ Value::Object(_)) => args.to_string(),
            _ => return None,
        },
        None => "{}".to_owned(),
        Some(_) => return None,
    };
    Some(ToolCall {
        id: call_id(),
        name: name.to_owned(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts_and_calls(pieces: &[Piece]) -> (String, Vec<(String, String)>) {
        let mut text = String::new();
        let mut calls = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => text.push_str(t),
                Piece::Call(c) => calls.push((c.name.clone(), c.arguments.clone())),
            }
        }
        (text, calls)
    }

    /// Feeds `output` in pieces of `step` bytes (on char boundaries).
    fn parse(format: ToolFormat, output: &str, step: usize) -> Vec<Piece> {
        let mut parser = CallParser::new(format);
        let mut pieces = Vec::new();
        let mut at = 0;
        while at < output.len() {
            let mut end = (at + step).min(output.len());
            while !output.is_char_boundary(end) {
                end += 1;
            }
            pieces.extend(parser.push(&output[at..end]));
            at = end;
        }
        pieces.extend(parser.finish());
        pieces
    }

    #[test]
    fn hermes_calls_come_out_whole_in_any_split() {
        let output = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 2, 3, 7, 1000] {
            let (text, calls) = texts_and_calls(&parse(ToolFormat::Hermes, output, step));
            assert_eq!(text, "", "step {step}");
            assert_eq!(
                calls,
                vec![
                    ("get_weather".into(), "{\"city\":\"Paris\"}".into()),
                    ("get_time".into(), "{}".into())
                ]
            );
        }
    }

    #[test]
    fn hermes_text_passes_through_and_keeps_lookalikes() {
        for step in [1, 4, 1000] {
            let (text, calls) =
                texts_and_calls(&parse(ToolFormat::Generic, "a <tool_ b < c\n", step));
            assert_eq!((text.as_str(), calls.len()), ("a <tool_ b < c\n", 0));
            let (text, calls) = texts_and_calls(&parse(
                ToolFormat::Hermes,
                "Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
                step,
            ));
            assert_eq!(text, "Let me check.");
            assert_eq!(calls, vec![("f".into(), "{\"x\":1}".into())]);
        }
    }

    #[test]
    fn a_call_cut_short_or_malformed_is_text() {
        let cut = "<tool_call>\n{\"name\": \"f\", \"argu";
        let (text, calls) = texts_and_calls(&parse(ToolFormat::Hermes, cut, 3));
        assert_eq!(text, cut);
        assert!(calls.is_empty());
        // After a whole call, a cut one is dropped.
        let whole = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let (text, calls) =
            texts_and_calls(&parse(ToolFormat::Hermes, &format!("{whole}\n{cut}"), 3));
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        let (text, calls) =
            texts_and_calls(&parse(ToolFormat::Hermes, "<tool_call>nope</tool_call>", 3));
        assert_eq!(text, "<tool_call>nope</tool_call>");
        assert!(calls.is_empty());
    }

    #[test]
    fn llama3_json_calls_and_text() {
        let (text, calls) = texts_and_calls(&parse(
            ToolFormat::Llama3,
            " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"t\", \"parameters\": {}}",
            5,
        ));
        assert_eq!(text, "");
        assert_eq!(
            calls,
            vec![
                ("get_weather".into(), "{\"city\":\"Paris\"}".into()),
                ("t".into(), "{}".into())
            ]
        );
        let (text, calls) = texts_and_calls(&parse(ToolFormat::Llama3, "It is {sunny}.", 2));
        assert_eq!((text.as_str(), calls.len()), ("It is {sunny}.", 0));
        let (text, calls) = texts_and_calls(&parse(ToolFormat::Llama3, "{not json", 2));
        assert_eq!((text.as_str(), calls.len()), ("{not json", 0));
    }

    #[test]
    fn formats_follow_the_template() {
        assert_eq!(ToolFormat::of_template(None), ToolFormat::Generic);
        assert_eq!(
            ToolFormat::of_template(Some("{% for m in messages %}{{ m.content }}{% endfor %}")),
            ToolFormat::Generic
        );
        assert_eq!(
            ToolFormat::of_template(Some("{% if tools %}<tool_call>{% endif %}")),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::of_template(Some("{% if tools %}<|python_tag|>{% endif %}")),
            ToolFormat::Llama3
        );
    }

    #[test]
    fn call_ids_are_distinct() {
        let a = call_id();
        assert!(a.starts_with("call_") && a.len() == 29);
        assert_ne!(a, call_id());
    }
}

/// The grammars compiled by llguidance against the real SmolLM2 vocabulary:
/// what they let through and what they stop.
#[cfg(test)]
mod grammar_tests {
    use super::*;
    use crate::engine::text::{TextCodec, smollm2};

    fn weather(choice: ToolChoice, parallel: bool) -> ToolUse {
        ToolUse {
            tools: vec![
                Tool {
                    name: "get_weather".into(),
                    description: Some("Weather in a city".into()),
                    parameters: json!({"type": "object", "properties": {
                        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                        "required": ["city"]}),
                },
                Tool {
                    name: "get_time".into(),
                    description: None,
                    parameters: json!({}),
                },
            ],
            choice,
            parallel,
        }
    }

    /// Whether the grammar lets the model write `text` (as the tokenizer
    /// spells it) and then stop.
    fn accepts(codec: &TextCodec, grammar: &Grammar, text: &str) -> bool {
        let rows = codec.vocab_size();
        let mut constraint = codec.grammars(rows).unwrap().compile(grammar).unwrap();
        let eos = codec.encode("<|im_end|>").unwrap()[0];
        let mut logits = vec![0.0f32; rows];
        for id in codec.encode(text).unwrap() {
            logits.fill(0.0);
            constraint.mask(&mut logits).unwrap();
            if logits[id as usize] == f32::NEG_INFINITY {
                return false;
            }
            constraint.advance(id).unwrap();
        }
        logits.fill(0.0);
        constraint.mask(&mut logits).unwrap();
        logits[eos as usize] != f32::NEG_INFINITY
    }

    const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

    #[test]
    fn required_allows_only_valid_calls() {
        let codec = smollm2();
        let g = grammar(
            ToolFormat::Generic,
            &weather(ToolChoice::Required, true),
            None,
        )
        .unwrap()
        .unwrap();
        assert!(accepts(&codec, &g, CALL));
        assert!(accepts(&codec, &g, &format!("{CALL}\n{CALL}")));
        assert!(!accepts(&codec, &g, "It is sunny."));
        // A name that is not a tool, a required argument missing, a wrong enum.
        assert!(!accepts(
            &codec,
            &g,
            &CALL.replace("get_weather", "get_wether")
        ));
        assert!(!accepts(
            &codec,
            &g,
            &CALL.replace("\"city\": \"Paris\"", "\"unit\": \"C\"")
        ));
        assert!(!accepts(
            &codec,
            &g,
            &CALL.replace("}}", ", \"unit\": \"K\"}}")
        ));
        let one = grammar(
            ToolFormat::Generic,
            &weather(ToolChoice::Required, false),
            None,
        )
        .unwrap()
        .unwrap();
        assert!(accepts(&codec, &one, CALL));
        assert!(!accepts(&codec, &one, &format!("{CALL}\n{CALL}")));
    }

    #[test]
    fn auto_allows_text_or_calls() {
        let codec = smollm2();
        let g = grammar(ToolFormat::Generic, &weather(ToolChoice::Auto, true), None)
            .unwrap()
            .unwrap();
        assert!(accepts(&codec, &g, "It is sunny in Paris."));
        assert!(accepts(&codec, &g, ""));
        assert!(accepts(&codec, &g, CALL));
        assert!(accepts(&codec, &g, &format!("Let me look.\n{CALL}")));
        assert!(!accepts(
            &codec,
            &g,
            &CALL.replace("get_weather", "get_wether")
        ));
    }

    #[test]
    fn a_named_tool_is_the_only_one() {
        let codec = smollm2();
        let named = ToolChoice::Function("get_time".into());
        let g = grammar(ToolFormat::Generic, &weather(named, true), None)
            .unwrap()
            .unwrap();
        assert!(!accepts(&codec, &g, CALL));
        assert!(accepts(
            &codec,
            &g,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
        ));
    }

    #[test]
    fn llama3_calls_or_text() {
        let codec = smollm2();
        let g = grammar(ToolFormat::Llama3, &weather(ToolChoice::Auto, false), None)
            .unwrap()
            .unwrap();
        assert!(accepts(&codec, &g, "It is sunny."));
        assert!(accepts(
            &codec,
            &g,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"
        ));
        assert!(!accepts(
            &codec,
            &g,
            "{\"name\": \"nope\", \"parameters\": {}}"
        ));
    }

    #[test]
    fn an_auto_answer_may_be_json() {
        let codec = smollm2();
        let answer = Grammar::JsonSchema(
            json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
        );
        let g = grammar(
            ToolFormat::Generic,
            &weather(ToolChoice::Auto, true),
            Some(&answer),
        )
        .unwrap()
        .unwrap();
        assert!(accepts(&codec, &g, "{\"ok\": true}"));
        assert!(accepts(&codec, &g, CALL));
        assert!(!accepts(&codec, &g, "It is sunny."));
        let regex = Grammar::Regex("[a-z]+".into());
        assert!(
            grammar(
                ToolFormat::Generic,
                &weather(ToolChoice::Auto, true),
                Some(&regex)
            )
            .is_err()
        );
        // `none`: the response format alone.
        let none = weather(ToolChoice::None, true);
        assert_eq!(
            grammar(ToolFormat::Generic, &none, Some(&regex)).unwrap(),
            Some(regex)
        );
    }
}
