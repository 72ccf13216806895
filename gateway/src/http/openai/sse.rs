//! Server-sent events for `stream: true`: each engine event becomes one
//! `data: {chunk}` frame as it arrives, then `data: [DONE]`.
//!
//! The response body owns the engine's event stream, so a client that hangs
//! up drops the body, which drops the stream and cancels the generation. A
//! client that stays connected but stops reading is cut off the same way
//! after `[server] stream_stall_timeout_secs` (see
//! [`SendWatch`](crate::http::inflight::SendWatch)), so it cannot hold a
//! batch slot until `max_tokens`.

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde::Serialize;

use super::engine::{EngineError, FinishReason, GenerateEvent, TokenOutput, Usage};
use super::tools::CallOut;
use super::types::{
    ChatChunk, ChatLogprobs, ChunkChoice, CompletionLogprobs, Delta, TextChoice, TextCompletion,
};
use crate::engine::tools::{self, CallParser, Piece};
use crate::http::{ApiError, Body, BoxError};

/// Which endpoint's chunk shape to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// Turns engine events into SSE frames for one streamed response.
#[derive(Debug)]
pub struct Framer {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub fingerprint: String,
    pub include_usage: bool,
    pub logprobs: bool,
    /// For the error event: which field the prompt came from.
    pub prompt_param: &'static str,
    /// Characters generated so far per choice (completions' `text_offset`).
    offsets: Vec<usize>,
    /// Choices not finished yet.
    open: usize,
    /// The usage of the finished choices, summed.
    usage: Option<Usage>,
    /// Per choice, when the request has tools: reads calls out of the
    /// text, which then go out as `delta.tool_calls`.
    pub call_parsers: Vec<CallParser>,
    /// Calls sent so far per choice (the next call's `index`).
    calls_out: Vec<usize>,
}

impl Framer {
    /// A framer for `choices` streams (`n`), each event tagged with its
    /// choice's index.
    pub fn new(kind: Kind, id: String, created: u64, model: String, choices: usize) -> Self {
        let choices = choices.max(1);
        Framer {
            kind,
            id,
            created,
            model,
            fingerprint: super::system_fingerprint(),
            include_usage: false,
            logprobs: false,
            prompt_param: match kind {
                Kind::Chat => "messages",
                Kind::Completion => "prompt",
            },
            offsets: vec![0; choices],
            open: choices,
            usage: None,
            call_parsers: Vec::new(),
            calls_out: vec![0; choices],
        }
    }

    /// What goes out before the first event: each choice's chat role chunk.
    pub fn start(&mut self) -> String {
        match self.kind {
            Kind::Chat => (0..self.offsets.len())
                .map(|index| {
                    self.chat_chunk(
                        index,
                        Delta {
                            role: Some("assistant"),
                            content: Some(String::new()),
                            tool_calls: Vec::new(),
                        },
                        None,
                        None,
                    )
                })
                .collect(),
            Kind::Completion => String::new(),
        }
    }

    /// Frames for one event of choice `index`, and whether the stream is
    /// over (every choice finished, or an error).
    pub fn event(
        &mut self,
        index: usize,
        event: Result<GenerateEvent, EngineError>,
    ) -> (String, bool) {
        match event {
            Ok(GenerateEvent::Delta { text, tokens, .. }) => {
                (self.delta(index, text, &tokens), false)
            }
            Ok(GenerateEvent::Finished { reason, usage }) => {
                let text = self.finish(index, reason, usage);
                (text, self.open == 0)
            }
            Err(e) => (
                error_frame(&ApiError::from_engine(e, self.prompt_param)),
                true,
            ),
        }
    }

    /// The engine's stream ended without saying why: report it as an error.
    pub fn cut_short(&mut self) -> String {
        error_frame(&ApiError::Internal(
            "the generation ended unexpectedly; the server log has details".into(),
        ))
    }

    fn delta(&mut self, index: usize, text: String, tokens: &[TokenOutput]) -> String {
        if text.is_empty() && (tokens.is_empty() || !self.logprobs) {
            return String::new();
        }
        match self.kind {
            Kind::Chat => {
                let logprobs = self.logprobs.then(|| ChatLogprobs::of(tokens));
                let pieces = tools::pieces(self.call_parsers.get_mut(index), text);
                self.chat_pieces(index, pieces, logprobs)
            }
            Kind::Completion => {
                let offset = &mut self.offsets[index];
                let logprobs = self.logprobs.then(|| {
                    let mut l = CompletionLogprobs::default();
                    l.push(tokens, offset);
                    l
                });
                if logprobs.is_none() {
                    *offset += text.chars().count();
                }
                self.text_chunk(index, text, logprobs, None)
            }
        }
    }

    /// Choice `index`'s last chunk; after the last choice's, the usage
    /// chunk (when asked for) and `[DONE]`.
    fn finish(&mut self, index: usize, reason: FinishReason, usage: Usage) -> String {
        let (mut out, reason) = match self.call_parsers.get_mut(index) {
            Some(parser) => {
                let rest = parser.finish();
                let calls = parser.calls();
                (
                    self.chat_pieces(index, rest, None),
                    Some(super::tools::finish_reason(reason, calls)),
                )
            }
            None => (String::new(), Some(reason.as_str())),
        };
        out += &match self.kind {
            Kind::Chat => self.chat_chunk(index, Delta::default(), None, reason),
            Kind::Completion => self.text_chunk(index, String::new(), None, reason),
        };
        self.open = self.open.saturating_sub(1);
        let usage = match self.usage.take() {
            Some(so_far) => so_far.with_choice(usage),
            None => usage,
        };
        if self.open > 0 {
            self.usage = Some(usage);
            return out;
        }
        if self.include_usage {
            let usage = Some(Some(usage.into()));
            out += &match self.kind {
                Kind::Chat => data_frame(&ChatChunk {
                    id: &self.id,
                    object: "chat.completion.chunk",
                    created: self.created,
                    model: &self.model,
                    system_fingerprint: &self.fingerprint,
                    choices: Vec::new(),
                    usage,
                }),
                Kind::Completion => data_frame(&TextCompletion {
                    id: &self.id,
                    object: "text_completion",
                    created: self.created,
                    model: &self.model,
                    system_fingerprint: &self.fingerprint,
                    choices: Vec::new(),
                    usage,
                }),
            };
        }
        out + "data: [DONE]\n\n"
    }

    /// Chunks for `pieces` of choice `index`: text as `content`, each call
    /// as two `tool_calls` deltas. `logprobs` ride on the first chunk (on
    /// an empty delta when the text is held back, so none are lost).
    fn chat_pieces(
        &mut self,
        index: usize,
        pieces: Vec<Piece>,
        mut logprobs: Option<ChatLogprobs>,
    ) -> String {
        let mut out = String::new();
        let mut deltas = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) => deltas.push(Delta {
                    content: Some(text),
                    ..Delta::default()
                }),
                Piece::Call(call) => {
                    let at = self.calls_out.get(index).copied().unwrap_or(0);
                    if let Some(n) = self.calls_out.get_mut(index) {
                        *n += 1;
                    }
                    deltas.extend(CallOut::streamed(at, call).map(|c| Delta {
                        tool_calls: vec![c],
                        ..Delta::default()
                    }));
                }
            }
        }
        if deltas.is_empty() && logprobs.as_ref().is_some_and(|l| !l.content.is_empty()) {
            deltas.push(Delta::default());
        }
        for delta in deltas {
            out += &self.chat_chunk(index, delta, logprobs.take(), None);
        }
        out
    }

    fn chat_chunk(
        &self,
        index: usize,
        delta: Delta,
        logprobs: Option<ChatLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> String {
        data_frame(&ChatChunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            system_fingerprint: &self.fingerprint,
            choices: vec![ChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason,
            }],
            usage: self.include_usage.then_some(None),
        })
    }

    fn text_chunk(
        &self,
        index: usize,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> String {
        data_frame(&TextCompletion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model,
            system_fingerprint: &self.fingerprint,
            choices: vec![TextChoice {
                text,
                index,
                logprobs,
                finish_reason,
            }],
            usage: self.include_usage.then_some(None),
        })
    }
}

fn data_frame<T: Serialize>(value: &T) -> String {
    // Our chunk types hold only strings and numbers: serialising cannot fail.
    let json = serde_json::to_string(value).unwrap_or_else(|_| "{}".into());
    format!("data: {json}\n\n")
}

/// An `error` event carrying the OpenAI error JSON; the stream ends after it.
pub fn error_frame(e: &ApiError) -> String {
    format!(
        "event: error\ndata: {}\n\n",
        String::from_utf8_lossy(&e.to_json())
    )
}

/// A `text/event-stream` response that writes each of `events` (tagged
/// with their choice's index) as it comes. The body owns `events`: dropping
/// the body (client gone) drops them.
pub fn response<S>(framer: Framer, events: S) -> Response<Body>
where
    S: Stream<Item = (usize, Result<GenerateEvent, EngineError>)> + Send + 'static,
{
    stream_response(frames(framer, events))
}

/// One generation's events in another API's streaming grammar (Anthropic's
/// Messages, OpenAI's Responses).
pub trait EventWriter: Send + 'static {
    /// What goes out before the first event.
    fn start(&mut self) -> String;
    /// Frames for one engine event, and whether the stream is over.
    fn on(&mut self, event: Result<GenerateEvent, EngineError>) -> (String, bool);
}

/// The SSE text `writer` makes of one generation's `events`; ends after
/// the writer's last frame, dropping `events` (which cancels the
/// generation) there. A stream that stops without finishing is an error.
pub fn writer_frames<W, S>(mut writer: W, events: S) -> impl Stream<Item = String> + Send + 'static
where
    W: EventWriter,
    S: Stream<Item = Result<GenerateEvent, EngineError>> + Send + 'static,
{
    let first = writer.start();
    let state = (Some(Box::pin(events)), writer);
    let rest = futures_util::stream::unfold(state, |(mut events, mut writer)| async move {
        loop {
            let stream = events.as_mut()?;
            let (text, done) = match stream.next().await {
                Some(e) => writer.on(e),
                None => writer.on(Err(EngineError::Internal(
                    "the generation ended without a finish reason".into(),
                ))),
            };
            if done {
                events = None;
            }
            if !text.is_empty() {
                return Some((text, (events, writer)));
            }
        }
    });
    futures_util::stream::iter([first]).chain(rest)
}

/// A `text/event-stream` response writing each of `frames` as it comes.
pub fn stream_response<S>(frames: S) -> Response<Body>
where
    S: Stream<Item = String> + Send + 'static,
{
    let frames = frames.map(|text| Ok::<_, BoxError>(Frame::data(Bytes::from(text))));
    let mut resp = Response::new(StreamBody::new(frames).boxed_unsync());
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tell buffering reverse proxies (nginx) to pass frames through at once.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

/// The SSE text, one non-empty piece per engine event (empty pieces are
/// skipped: an empty chunk would end a chunked HTTP body). Ends after the
/// `Finished` event or an error, dropping `events` there.
pub fn frames<S>(framer: Framer, events: S) -> impl Stream<Item = String> + Send + 'static
where
    S: Stream<Item = (usize, Result<GenerateEvent, EngineError>)> + Send + 'static,
{
    struct State<S> {
        events: Option<std::pin::Pin<Box<S>>>,
        framer: Framer,
        started: bool,
    }
    let state = State {
        events: Some(Box::pin(events)),
        framer,
        started: false,
    };
    futures_util::stream::unfold(state, |mut st| async move {
        if !st.started {
            st.started = true;
            let first = st.framer.start();
            if !first.is_empty() {
                return Some((first, st));
            }
        }
        loop {
            let events = st.events.as_mut()?;
            let (text, done) = match events.next().await {
                Some((index, event)) => st.framer.event(index, event),
                None => (st.framer.cut_short(), true),
            };
            if done {
                // Cancel/free the generation now rather than when the body goes.
                st.events = None;
            }
            if !text.is_empty() {
                return Some((text, st));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn tok(text: &str) -> TokenOutput {
        TokenOutput {
            id: 7,
            text: text.into(),
            logprob: Some(-0.5),
            top_logprobs: vec![(text.into(), -0.5)],
        }
    }

    fn delta(text: &str) -> Result<GenerateEvent, EngineError> {
        Ok(GenerateEvent::Delta {
            text: text.into(),
            tokens: vec![tok(text)],
            generated: 1,
        })
    }

    fn finished(reason: FinishReason) -> Result<GenerateEvent, EngineError> {
        Ok(GenerateEvent::Finished {
            reason,
            usage: Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                cached_tokens: 0,
            },
        })
    }

    fn framer(kind: Kind) -> Framer {
        Framer::new(kind, "chatcmpl-abc".into(), 1700000000, "m".into(), 1)
    }

    /// Runs one choice's `events` through the body (see [`run_choices`]).
    fn run(
        framer: Framer,
        events: Vec<Result<GenerateEvent, EngineError>>,
    ) -> Vec<(String, String)> {
        run_choices(framer, events.into_iter().map(|e| (0, e)).collect())
    }

    /// Runs `events` (tagged with their choice) through the body and splits
    /// the SSE text into events: (event name, data) pairs.
    fn run_choices(
        framer: Framer,
        events: Vec<(usize, Result<GenerateEvent, EngineError>)>,
    ) -> Vec<(String, String)> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let resp = response(framer, futures_util::stream::iter(events));
        assert_eq!(resp.headers()[CONTENT_TYPE], "text/event-stream");
        assert_eq!(resp.headers()[CACHE_CONTROL], "no-cache");
        let bytes = rt.block_on(resp.into_body().collect()).unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        assert!(text.ends_with("\n\n"), "{text:?}");
        text.trim_end()
            .split("\n\n")
            .map(|ev| {
                let mut name = String::new();
                let mut data = String::new();
                for line in ev.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.into();
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = d.into();
                    } else {
                        panic!("unexpected SSE line {line:?}");
                    }
                }
                (name, data)
            })
            .collect()
    }

    fn json_of(data: &str) -> Value {
        serde_json::from_str(data).unwrap()
    }

    #[test]
    fn chat_stream_role_first_then_content_then_finish_then_done() {
        let ev = run(
            framer(Kind::Chat),
            vec![delta("Hel"), delta("lo"), finished(FinishReason::Length)],
        );
        assert_eq!(ev.len(), 5, "{ev:?}");
        let first = json_of(&ev[0].1);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["id"], "chatcmpl-abc");
        assert_eq!(first["model"], "m");
        assert_eq!(first["created"], 1700000000);
        assert_eq!(
            first["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert!(first.get("usage").is_none(), "no usage key unless asked");
        assert_eq!(
            json_of(&ev[1].1)["choices"][0]["delta"],
            json!({"content": "Hel"})
        );
        assert_eq!(json_of(&ev[1].1)["choices"][0]["logprobs"], Value::Null);
        assert_eq!(
            json_of(&ev[2].1)["choices"][0]["delta"],
            json!({"content": "lo"})
        );
        let last = json_of(&ev[3].1);
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(ev[4], (String::new(), "[DONE]".to_owned()));
    }

    #[test]
    fn chat_stream_usage_chunk_when_asked() {
        let mut f = framer(Kind::Chat);
        f.include_usage = true;
        let ev = run(f, vec![delta("a"), finished(FinishReason::Stop)]);
        assert_eq!(ev.len(), 5, "{ev:?}");
        assert_eq!(json_of(&ev[0].1)["usage"], Value::Null);
        assert!(json_of(&ev[0].1).get("usage").is_some());
        assert_eq!(json_of(&ev[2].1)["choices"][0]["finish_reason"], "stop");
        let usage = json_of(&ev[3].1);
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                   "prompt_tokens_details": {"cached_tokens": 0}})
        );
        assert_eq!(ev[4].1, "[DONE]");
    }

    #[test]
    fn chat_stream_logprobs() {
        let mut f = framer(Kind::Chat);
        f.logprobs = true;
        let ev = run(f, vec![delta("a"), finished(FinishReason::Stop)]);
        assert_eq!(
            json_of(&ev[1].1)["choices"][0]["logprobs"],
            json!({"content": [{"token": "a", "logprob": -0.5, "bytes": [97],
                "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}]})
        );
    }

    #[test]
    fn empty_deltas_are_skipped() {
        let ev = run(
            framer(Kind::Chat),
            vec![
                Ok(GenerateEvent::Delta {
                    text: String::new(),
                    tokens: vec![tok("")],
                    generated: 1,
                }),
                finished(FinishReason::Stop),
            ],
        );
        assert_eq!(ev.len(), 3, "{ev:?}");
    }

    #[test]
    fn error_mid_stream_sends_error_event_and_stops() {
        let ev = run(
            framer(Kind::Chat),
            vec![
                delta("a"),
                Err(EngineError::Internal("boom".into())),
                delta("never"),
            ],
        );
        assert_eq!(ev.len(), 3, "{ev:?}");
        assert_eq!(ev[2].0, "error");
        let e = json_of(&ev[2].1);
        assert_eq!(e["error"]["type"], "server_error");
        assert_eq!(e["error"]["code"], "internal_error");
        assert!(e["error"]["message"].as_str().unwrap().contains("boom"));
        assert!(!ev.iter().any(|(_, d)| d == "[DONE]"));
    }

    #[test]
    fn stream_that_ends_without_finish_is_an_error() {
        let ev = run(framer(Kind::Chat), vec![delta("a")]);
        assert_eq!(ev.last().unwrap().0, "error");
    }

    #[test]
    fn completion_stream_shape() {
        let mut f = framer(Kind::Completion);
        f.include_usage = true;
        f.logprobs = true;
        let ev = run(
            f,
            vec![delta("ab"), delta("c"), finished(FinishReason::Stop)],
        );
        assert_eq!(ev.len(), 5, "{ev:?}");
        let first = json_of(&ev[0].1);
        assert_eq!(first["object"], "text_completion");
        assert_eq!(first["choices"][0]["text"], "ab");
        assert_eq!(first["choices"][0]["logprobs"]["text_offset"], json!([0]));
        assert_eq!(
            json_of(&ev[1].1)["choices"][0]["logprobs"]["text_offset"],
            json!([2])
        );
        let fin = json_of(&ev[2].1);
        assert_eq!(fin["choices"][0]["text"], "");
        assert_eq!(fin["choices"][0]["finish_reason"], "stop");
        assert_eq!(json_of(&ev[3].1)["usage"]["total_tokens"], 7);
        assert_eq!(ev[4].1, "[DONE]");
    }

    #[test]
    fn choices_stream_interleaved_and_end_after_the_last_with_summed_usage() {
        let mut f = Framer::new(Kind::Chat, "chatcmpl-abc".into(), 1, "m".into(), 2);
        f.include_usage = true;
        let ev = run_choices(
            f,
            vec![
                (1, delta("b")),
                (0, delta("a")),
                (1, finished(FinishReason::Stop)),
                (0, finished(FinishReason::Length)),
            ],
        );
        let choices: Vec<(u64, Value, Value)> = ev
            .iter()
            .filter(|(_, data)| data != "[DONE]")
            .map(|(_, data)| json_of(data))
            .filter_map(|chunk| {
                let c = chunk["choices"].get(0)?.clone();
                Some((
                    c["index"].as_u64()?,
                    c["delta"].clone(),
                    c["finish_reason"].clone(),
                ))
            })
            .collect();
        assert_eq!(
            choices,
            vec![
                (0, json!({"role": "assistant", "content": ""}), Value::Null),
                (1, json!({"role": "assistant", "content": ""}), Value::Null),
                (1, json!({"content": "b"}), Value::Null),
                (0, json!({"content": "a"}), Value::Null),
                (1, json!({}), json!("stop")),
                (0, json!({}), json!("length")),
            ]
        );
        let usage = json_of(&ev[ev.len() - 2].1);
        assert_eq!(usage["usage"]["prompt_tokens"], 5);
        assert_eq!(usage["usage"]["completion_tokens"], 4);
        assert_eq!(ev.last().unwrap().1, "[DONE]");
    }

    #[test]
    fn dropping_the_body_drops_the_events() {
        struct Guard(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guard = Guard(dropped.clone());
        let events = futures_util::stream::pending().map(move |e| {
            let _ = &guard;
            (0, e)
        });
        let resp = response(framer(Kind::Chat), events);
        assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
        drop(resp);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }
}
