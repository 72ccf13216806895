//! Token usage of proxied answers, counted as they pass through
//! (`mlxgate_upstream_tokens_total{upstream,kind}`).
//!
//! A whole JSON answer carries `usage` at its top level (OpenAI's
//! `prompt_tokens`/`completion_tokens`, Anthropic's and Responses'
//! `input_tokens`/`output_tokens`). A streamed one carries it in its
//! events: OpenAI's last chunk when `stream_options.include_usage` is set,
//! Anthropic's `message_start` and `message_delta`, Responses'
//! `response.completed`. A streamed OpenAI request whose client did not ask
//! for usage is sent with `include_usage` set ([`ask_for_usage`]), and the
//! usage-only chunk that brings is taken out of the stream before the
//! client sees it (the other chunks then carry `"usage": null`, which
//! clients ignore).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use serde::Deserialize;
use serde_json::Value;

use crate::util::BoxError;

/// Most bytes of a whole answer kept to read its usage; a longer one is
/// passed on uncounted.
const MAX_WHOLE_ANSWER: usize = 1 << 20;

/// `body` with `stream_options.include_usage` set, when it is a streamed
/// OpenAI request that does not ask for usage; `None` leaves it as it is.
pub fn ask_for_usage(body: &[u8]) -> Option<Bytes> {
    let mut json: Value = serde_json::from_slice(body).ok()?;
    let obj = json.as_object_mut()?;
    if obj.get("stream") != Some(&Value::Bool(true)) {
        return None;
    }
    let options = obj
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Default::default()));
    let options = options.as_object_mut()?;
    if options.get("include_usage") == Some(&Value::Bool(true)) {
        return None;
    }
    options.insert("include_usage".into(), Value::Bool(true));
    serde_json::to_vec(&json).ok().map(Bytes::from)
}

/// Token counts in the shapes upstreams write them.
#[derive(Debug, Default, Deserialize, Clone, Copy, PartialEq)]
struct Counts {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

/// Where an answer or an event keeps its usage.
#[derive(Debug, Default, Deserialize)]
struct Carrier {
    usage: Option<Counts>,
    message: Option<Inner>,
    response: Option<Inner>,
    /// OpenAI's usage-only chunk has no choices.
    choices: Option<Vec<serde::de::IgnoredAny>>,
}

#[derive(Debug, Default, Deserialize)]
struct Inner {
    usage: Option<Counts>,
}

impl Carrier {
    fn counts(&self) -> Option<Counts> {
        self.usage
            .or_else(|| self.message.as_ref().and_then(|m| m.usage))
            .or_else(|| self.response.as_ref().and_then(|r| r.usage))
    }
}

/// The usage seen so far: the latest value of each count wins (Anthropic's
/// `message_delta` repeats the running output count).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Usage {
    prompt: u64,
    completion: u64,
}

impl Usage {
    fn take(&mut self, c: Counts) {
        if let Some(p) = c.prompt_tokens.or(c.input_tokens) {
            self.prompt = p;
        }
        if let Some(n) = c.completion_tokens.or(c.output_tokens) {
            self.completion = n;
        }
    }
}

/// What a proxied answer's usage (prompt, completion tokens) is given to
/// when the answer ends or is dropped.
pub type UsageSink = Box<dyn FnOnce(u64, u64) + Send>;

/// A proxied answer's body, passed on while its usage is read; the counts
/// go to its sink when it ends or is dropped.
pub struct UsageTap<B> {
    inner: B,
    /// Server-sent events (else one JSON document).
    events: bool,
    /// Take the usage-only chunk out (the client did not ask for it).
    strip: bool,
    /// SSE: an event not yet complete. JSON: the answer so far, after its
    /// first frame (most answers come in one, kept in `first` uncopied).
    pending: BytesMut,
    first: Option<Bytes>,
    /// A JSON answer longer than [`MAX_WHOLE_ANSWER`]: not read.
    too_long: bool,
    usage: Usage,
    sink: Option<UsageSink>,
}

impl<B> UsageTap<B> {
    pub fn new(inner: B, events: bool, strip: bool, sink: UsageSink) -> Self {
        UsageTap {
            inner,
            events,
            strip,
            pending: BytesMut::new(),
            first: None,
            too_long: false,
            usage: Usage::default(),
            sink: Some(sink),
        }
    }

    /// Keeps a frame of a whole answer to read its usage at the end.
    fn keep_whole(&mut self, data: &Bytes) {
        if self.too_long {
            return;
        }
        if self.first.is_none() && self.pending.is_empty() {
            self.first = Some(data.clone());
            return;
        }
        let first = self.first.take().unwrap_or_default();
        if self.pending.len() + first.len() + data.len() > MAX_WHOLE_ANSWER {
            self.too_long = true;
            self.pending = BytesMut::new();
            return;
        }
        self.pending.extend_from_slice(&first);
        self.pending.extend_from_slice(data);
    }

    /// Reads the complete events of `pending` and returns what the client
    /// gets of them (the usage-only chunk left out when stripping).
    fn complete_events(&mut self) -> Bytes {
        let Some(end) = find_last(&self.pending, b"\n\n") else {
            return Bytes::new();
        };
        let complete = self.pending.split_to(end + 2).freeze();
        if !self.strip {
            self.read_events(&complete);
            return complete;
        }
        let mut out = BytesMut::with_capacity(complete.len());
        for event in split_events(&complete) {
            let carrier = data_of(event).and_then(|d| serde_json::from_slice::<Carrier>(d).ok());
            if let Some(c) = &carrier
                && let Some(counts) = c.counts()
            {
                self.usage.take(counts);
                if c.choices.as_ref().is_some_and(Vec::is_empty) {
                    continue;
                }
            }
            out.extend_from_slice(event);
        }
        out.freeze()
    }

    /// Reads the usage of every event in `text` (complete events).
    fn read_events(&mut self, text: &[u8]) {
        for event in split_events(text) {
            // Most events carry no usage: a substring test before parsing.
            let Some(data) = data_of(event).filter(|d| contains(d, b"usage")) else {
                continue;
            };
            if let Some(counts) = serde_json::from_slice::<Carrier>(data)
                .ok()
                .and_then(|c| c.counts())
            {
                self.usage.take(counts);
            }
        }
    }

    fn record(&mut self) {
        if !self.events {
            let whole = match (self.first.take(), self.pending.is_empty()) {
                (Some(first), true) => first,
                (_, _) => self.pending.split().freeze(),
            };
            // Most answers without usage are told by a substring test.
            if contains(&whole, b"\"usage\"")
                && let Some(counts) = serde_json::from_slice::<Carrier>(&whole)
                    .ok()
                    .and_then(|c| c.counts())
            {
                self.usage.take(counts);
            }
        }
        let usage = std::mem::take(&mut self.usage);
        if let Some(sink) = self.sink.take() {
            sink(usage.prompt, usage.completion);
        }
    }
}

impl<B> Drop for UsageTap<B> {
    fn drop(&mut self) {
        self.record();
    }
}

impl<B> Body for UsageTap<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(None) => {
                    // A last event without its blank line goes as it came.
                    if this.events && !this.pending.is_empty() {
                        let rest = this.pending.split().freeze();
                        this.read_events(&rest);
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    this.record();
                    return Poll::Ready(None);
                }
                other => return other,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if !this.events {
                this.keep_whole(&data);
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            this.pending.extend_from_slice(&data);
            let out = this.complete_events();
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        (!self.events || self.pending.is_empty()) && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.strip {
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}

/// The events of `text` (each with its blank line).
fn split_events(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = find(rest, b"\n\n").map_or(rest.len(), |i| i + 2);
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// The `data:` payload of an event (its first data line).
fn data_of(event: &[u8]) -> Option<&[u8]> {
    event.split(|b| *b == b'\n').find_map(|line| {
        let data = line.strip_prefix(b"data:")?;
        Some(data.strip_prefix(b" ").unwrap_or(data))
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    find(hay, needle).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use http_body_util::{BodyExt, StreamBody};

    type Counted = Arc<std::sync::Mutex<Option<(u64, u64)>>>;

    async fn tap(parts: &[&str], events: bool, strip: bool) -> (String, Counted) {
        let counted = Counted::default();
        let into = Arc::clone(&counted);
        let sink = Box::new(move |p, c| *into.lock().unwrap() = Some((p, c)));
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from(p.to_string()))))
            .collect();
        let inner = StreamBody::new(futures_util::stream::iter(frames));
        let body = UsageTap::new(inner, events, strip, sink);
        let out = body.collect().await.unwrap().to_bytes();
        (String::from_utf8(out.to_vec()).unwrap(), counted)
    }

    fn counted(c: &Counted) -> Option<(u64, u64)> {
        *c.lock().unwrap()
    }

    const CHUNK: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n";
    const USAGE: &str =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\n";

    #[tokio::test]
    async fn openai_streams_are_counted_and_the_asked_for_chunk_taken_out() {
        let split = [
            &CHUNK[..10],
            &CHUNK[10..],
            &USAGE[..30],
            &USAGE[30..],
            "data: [DONE]\n\n",
        ];
        let (out, m) = tap(&split, true, true).await;
        assert_eq!(out, format!("{CHUNK}data: [DONE]\n\n"));
        assert_eq!(counted(&m), Some((7, 2)));
        // The client asked: it keeps the chunk.
        let (out, m) = tap(&split, true, false).await;
        assert_eq!(out, format!("{CHUNK}{USAGE}data: [DONE]\n\n"));
        assert_eq!(counted(&m), Some((7, 2)));
    }

    #[tokio::test]
    async fn anthropic_streams_and_whole_answers_are_counted() {
        let events = [
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":11,\"output_tokens\":1}}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":5}}\n\n",
        ];
        let (out, m) = tap(&events, true, false).await;
        assert_eq!(out, events.concat());
        assert_eq!(counted(&m), Some((11, 5)));
        let whole = r#"{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        let (out, m) = tap(&[&whole[..9], &whole[9..]], false, false).await;
        assert_eq!(out, whole);
        assert_eq!(counted(&m), Some((3, 4)));
    }

    #[test]
    fn usage_is_asked_for_only_when_streaming_without_it() {
        let asked =
            ask_for_usage(br#"{"model":"m","stream":true,"stream_options":{"x":1}}"#).unwrap();
        let v: Value = serde_json::from_slice(&asked).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"x": 1, "include_usage": true})
        );
        assert!(ask_for_usage(br#"{"model":"m"}"#).is_none());
        assert!(
            ask_for_usage(br#"{"stream":true,"stream_options":{"include_usage":true}}"#).is_none()
        );
    }
}
