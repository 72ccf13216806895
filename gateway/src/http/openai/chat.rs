//! `POST /v1/chat/completions`.

use http::{Request, StatusCode};
use serde_json::Value;

use super::sse::{self, Framer, Kind};
use super::tools::{self, CallOut};
use super::types::{AssistantMessage, ChatChoice, ChatCompletion, ChatLogprobs};
use super::{ApiParams, HandlerResult, collect_all, merged, start_chat, total_usage, validate};
use crate::http::body::{self, ReqBody};
use crate::http::routing::{self, Routed};
use crate::http::{ApiError, Ctx};
use crate::util::time::unix_secs;

pub async fn create(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    // Routing first: a router policy may send this request upstream or refuse it.
    let local = match routing::dispatch(&cx, req, validate::Endpoint::Chat).await? {
        Routed::Local(local) => local,
        Routed::Proxied(resp) => return Ok(resp),
    };
    let json: &Value = &local.json;
    let chat = validate::chat_request(json)?;
    let n = chat.common.n;
    let started = start_chat(
        &cx,
        &local,
        &chat.common,
        chat.messages,
        chat.tools,
        ApiParams::from("messages"),
    )
    .await?;
    let mut parsers: Vec<_> = (0..n).map(|_| started.call_parser()).collect();
    let (model, streams) = (started.model, started.streams);
    let engine_err = |e| ApiError::from_engine(e, "messages");

    let id = format!("chatcmpl-{}", cx.request_id);
    let created = unix_secs();
    let logprobs = chat.common.logprobs.is_some();
    if chat.common.stream {
        let mut framer = Framer::new(Kind::Chat, id, created, model.id, n);
        framer.include_usage = chat.common.include_usage;
        framer.logprobs = logprobs;
        framer.call_parsers = parsers.into_iter().flatten().collect();
        return Ok(sse::response(framer, merged(streams)));
    }
    let done = collect_all(streams, logprobs).await.map_err(engine_err)?;
    let usage = total_usage(&done);
    body::json(
        StatusCode::OK,
        &ChatCompletion {
            id,
            object: "chat.completion",
            created,
            model: model.id,
            choices: done
                .into_iter()
                .enumerate()
                .map(|(index, done)| {
                    let (content, calls) = match parsers[index].take() {
                        Some(parser) => tools::read_answer(parser, &done.text),
                        None => (Some(done.text), Vec::new()),
                    };
                    ChatChoice {
                        index,
                        finish_reason: tools::finish_reason(done.reason, calls.len()),
                        message: AssistantMessage {
                            role: "assistant",
                            content,
                            refusal: None,
                            tool_calls: calls.into_iter().map(CallOut::whole).collect(),
                        },
                        logprobs: logprobs.then(|| ChatLogprobs::of(&done.tokens)),
                    }
                })
                .collect(),
            usage: usage.into(),
            system_fingerprint: super::system_fingerprint(),
        },
    )
    .map(|resp| local.meter.timed(resp))
}
