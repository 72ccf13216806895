//! Anthropic's streaming grammar for one message: `message_start`, `ping`,
//! then per content block `content_block_start`, `content_block_delta`s
//! (`text_delta`, or one `input_json_delta` with a call's whole input) and
//! `content_block_stop`, then `message_delta` (stop reason, usage) and
//! `message_stop`. An error mid-stream is an `error` event, and the end.

use serde_json::{Value, json};

use super::{error_json, stop_reason, tool_use_block, usage};
use crate::engine::tools::{self, CallParser, Piece};
use crate::engine::{EngineError, GenerateEvent};
use crate::http::ApiError;
use crate::http::openai::sse::EventWriter;

/// Turns one generation's events into Anthropic events.
pub struct Writer {
    id: String,
    model: String,
    prompt_tokens: usize,
    parser: Option<CallParser>,
    /// The index of the open text block, if one is open.
    open_text: Option<usize>,
    /// Blocks started so far (the next block's index).
    blocks: usize,
    calls: usize,
    /// The request's stop sequences, to name the one that fired.
    stops: Vec<String>,
}

impl Writer {
    pub fn new(
        id: String,
        model: String,
        prompt_tokens: usize,
        parser: Option<CallParser>,
        stops: Vec<String>,
    ) -> Self {
        Writer {
            id,
            model,
            prompt_tokens,
            parser,
            open_text: None,
            blocks: 0,
            calls: 0,
            stops,
        }
    }

    /// `message_start` (prompt tokens as `input_tokens`: the cached share
    /// is known at the end, in `message_delta`) and a `ping`.
    fn head(&self) -> String {
        event(
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}}),
        ) + &event("ping", &json!({"type": "ping"}))
    }

    /// Events for `pieces` of the output.
    fn pieces(&mut self, pieces: Vec<Piece>) -> String {
        let mut out = String::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) if text.is_empty() => {}
                Piece::Text(text) => {
                    let index = match self.open_text {
                        Some(index) => index,
                        None => {
                            let index = self.next_block();
                            self.open_text = Some(index);
                            out += &event(
                                "content_block_start",
                                &json!({"type": "content_block_start", "index": index,
                                        "content_block": {"type": "text", "text": ""}}),
                            );
                            index
                        }
                    };
                    out += &event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": index,
                                "delta": {"type": "text_delta", "text": text}}),
                    );
                }
                Piece::Call(call) => {
                    out += &self.close_text();
                    self.calls += 1;
                    let index = self.next_block();
                    let mut block = tool_use_block(call);
                    let input = std::mem::replace(&mut block["input"], json!({}));
                    out += &event(
                        "content_block_start",
                        &json!({"type": "content_block_start", "index": index, "content_block": block}),
                    );
                    out += &event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
                    );
                    out += &event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": index}),
                    );
                }
            }
        }
        out
    }

    fn next_block(&mut self) -> usize {
        self.blocks += 1;
        self.blocks - 1
    }

    fn close_text(&mut self) -> String {
        match self.open_text.take() {
            Some(index) => event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ),
            None => String::new(),
        }
    }
}

impl EventWriter for Writer {
    fn start(&mut self) -> String {
        self.head()
    }

    /// Events for one engine event, and whether the stream is over.
    fn on(&mut self, e: Result<GenerateEvent, EngineError>) -> (String, bool) {
        match e {
            Ok(GenerateEvent::Delta { text, .. }) => {
                let pieces = tools::pieces(self.parser.as_mut(), text);
                (self.pieces(pieces), false)
            }
            Ok(GenerateEvent::Finished { reason, usage: u }) => {
                let rest = tools::rest(self.parser.as_mut());
                let mut out = self.pieces(rest);
                out += &self.close_text();
                let (stop_reason, stop_sequence) = stop_reason(reason, self.calls, &self.stops);
                out += &event(
                    "message_delta",
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": usage(u)}),
                );
                out += &event("message_stop", &json!({"type": "message_stop"}));
                (out, true)
            }
            Err(e) => (
                event("error", &error_json(&ApiError::from_engine(e, "messages"))),
                true,
            ),
        }
    }
}

/// One server-sent event of Anthropic's stream.
pub(super) fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}
