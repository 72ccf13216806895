//! The `response.*` events of a streamed response: `response.created`,
//! `response.in_progress`; per output item `response.output_item.added`,
//! for text `response.content_part.added`, `response.output_text.delta`s,
//! `response.output_text.done`, `response.content_part.done`, for a call
//! `response.function_call_arguments.delta` and `.done` (its whole
//! arguments: calls come out whole), then `response.output_item.done`; and
//! last `response.completed` (or `response.incomplete` when
//! `max_output_tokens` cut it) with the whole response, which is stored
//! then. Every event carries its `sequence_number`.

use serde_json::{Value, json};

use super::{Echo, Keeper, call_item, message_item};
use crate::engine::tools::{self, CallParser, Piece};
use crate::engine::{EngineError, FinishReason, GenerateEvent, ToolCall};
use crate::http::ApiError;
use crate::http::openai::sse::EventWriter;

pub struct Writer {
    echo: Echo,
    parser: Option<CallParser>,
    keeper: Option<Keeper>,
    sequence: u64,
    /// The text so far, and whether its message item is open.
    text: String,
    text_open: bool,
    /// Finished output items.
    output: Vec<Value>,
    calls: Vec<ToolCall>,
}

impl Writer {
    pub fn new(echo: Echo, parser: Option<CallParser>, keeper: Keeper) -> Writer {
        Writer {
            echo,
            parser,
            keeper: Some(keeper),
            sequence: 0,
            text: String::new(),
            text_open: false,
            output: Vec::new(),
            calls: Vec::new(),
        }
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.echo.id.trim_start_matches("resp_"))
    }

    fn event(&mut self, kind: &str, mut data: Value) -> String {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        format!("event: {kind}\ndata: {data}\n\n")
    }

    fn head(&mut self) -> String {
        let response = self.echo.response("in_progress", Vec::new(), None, None);
        self.event("response.created", json!({"response": response.clone()}))
            + &self.event("response.in_progress", json!({"response": response}))
    }

    fn open_text(&mut self) -> String {
        if self.text_open {
            return String::new();
        }
        self.text_open = true;
        let (id, index) = (self.message_id(), self.output.len());
        self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": {"type": "message", "id": id, "status": "in_progress",
                   "role": "assistant", "content": []}}),
        ) + &self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        )
    }

    fn close_text(&mut self) -> String {
        if !self.text_open {
            return String::new();
        }
        self.text_open = false;
        let (id, index, text) = (self.message_id(), self.output.len(), self.text.clone());
        let item = message_item(&id, &text);
        let out = self.event(
            "response.output_text.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
        ) + &self.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": item["content"][0].clone()}),
        ) + &self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item.clone()}),
        );
        self.output.push(item);
        out
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> String {
        let mut out = String::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) if text.is_empty() => {}
                Piece::Text(text) => {
                    out += &self.open_text();
                    self.text.push_str(&text);
                    let (id, index) = (self.message_id(), self.output.len());
                    out += &self.event(
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "delta": text, "logprobs": []}),
                    );
                }
                Piece::Call(call) => {
                    out += &self.close_text();
                    let item = call_item(&call);
                    let index = self.output.len();
                    let mut added = item.clone();
                    added["arguments"] = json!("");
                    added["status"] = json!("in_progress");
                    out += &self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": added}),
                    );
                    out += &self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": item["id"], "output_index": index, "delta": call.arguments}),
                    );
                    out += &self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": item["id"], "output_index": index, "arguments": call.arguments}),
                    );
                    out += &self.event(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item.clone()}),
                    );
                    self.output.push(item);
                    self.calls.push(call);
                }
            }
        }
        out
    }
}

impl EventWriter for Writer {
    fn start(&mut self) -> String {
        self.head()
    }

    fn on(&mut self, e: Result<GenerateEvent, EngineError>) -> (String, bool) {
        match e {
            Ok(GenerateEvent::Delta { text, .. }) => {
                let pieces = tools::pieces(self.parser.as_mut(), text);
                (self.pieces(pieces), false)
            }
            Ok(GenerateEvent::Finished { reason, usage }) => {
                let rest = tools::rest(self.parser.as_mut());
                let mut out = self.pieces(rest);
                // As whole: a message item unless the answer is only calls.
                if self.calls.is_empty() {
                    out += &self.open_text();
                }
                out += &self.close_text();
                let response = self.echo.response(
                    "completed",
                    std::mem::take(&mut self.output),
                    Some(usage),
                    Some(reason),
                );
                if let Some(keeper) = self.keeper.take() {
                    keeper.keep(
                        &self.echo,
                        &response,
                        &self.text,
                        std::mem::take(&mut self.calls),
                    );
                }
                let kind = match reason {
                    FinishReason::Length => "response.incomplete",
                    _ => "response.completed",
                };
                out += &self.event(kind, json!({"response": response}));
                (out, true)
            }
            Err(e) => {
                let e = ApiError::from_engine(e, "input");
                let data = json!({"code": e.code(), "message": e.to_string(), "param": e.param()});
                (self.event("error", data), true)
            }
        }
    }
}
