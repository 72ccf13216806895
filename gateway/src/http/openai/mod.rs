//! The OpenAI inference API: `POST /v1/chat/completions` and
//! `POST /v1/completions`, whole or streamed as server-sent events.
//!
//! Handlers stay thin: [`validate`] turns the JSON body into a checked
//! request (400s name the offending field), the model registry finds the
//! engine (404 unknown, 503 still loading), the engine generates, and
//! [`types`] / [`sse`] shape the answer. Every error goes through
//! [`ApiError`](crate::http::ApiError).

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod sse;
pub mod tools;
pub mod types;
pub mod validate;

pub use crate::engine;

use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use http::{Method, Response};

use crate::app::LoadedModel;
use crate::engine::tools::CallParser;
use crate::engine::{
    ChatMessage, EngineError, FinishReason, GenerateEvent, GenerateRequest, GenerationStream,
    Prompt, TokenOutput, ToolUse, Usage,
};
use crate::http::adapters;
pub use crate::http::error::ApiParams;
use crate::http::routing::Local;
use crate::http::{ApiError, Body, Ctx, Route};

pub type HandlerResult = Result<Response<Body>, ApiError>;

/// The inference routes, for the route table.
pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::POST, "/v1/chat/completions", |cx, req| {
            Box::pin(chat::create(cx, req))
        }),
        Route::new(Method::POST, "/v1/completions", |cx, req| {
            Box::pin(completions::create(cx, req))
        }),
        Route::new(Method::POST, "/v1/embeddings", |cx, req| {
            Box::pin(embeddings::create(cx, req))
        }),
    ]
}

/// The engine request for a validated body: checks what needs the model
/// (token ids in `logit_bias` within the vocabulary) and picks the request's
/// adapters (body, header or adapter-selector policy, which sees the
/// prompt's length when `prompt` is already tokenized).
pub async fn generate_request(
    cx: &Ctx,
    local: &Local,
    prompt: Prompt,
    common: &validate::Common,
    model: &LoadedModel,
) -> Result<GenerateRequest, ApiError> {
    let vocab = model.engine.card().vocab_size;
    if let Some(id) = common
        .sampling
        .logit_bias
        .keys()
        .find(|&&id| id as usize >= vocab)
    {
        return Err(ApiError::InvalidParam {
            message: format!(
                "Invalid key in 'logit_bias': token id {id} is outside the vocabulary of `{}` ({vocab} tokens).",
                model.id
            ),
            param: "logit_bias".into(),
            code: "invalid_value",
        });
    }
    let prompt_tokens = match &prompt {
        Prompt::Tokens(ids) => ids.len(),
        Prompt::Text(_) => 0,
    };
    let adapters = adapters::for_request(cx, local, common, model, prompt_tokens).await?;
    Ok(GenerateRequest {
        prompt,
        sampling: common.sampling.clone(),
        max_tokens: common.max_tokens,
        stop: common.stop.clone(),
        logprobs: common.logprobs,
        prompt_cache: common.prompt_cache.clone(),
        adapters,
        cache_scope: crate::http::prompt_caches::scope(cx, local.head.extensions.get()),
        grammar: common.grammar.clone(),
        priority: local.priority,
    })
}

/// A chat generation begun (by any of the chat-shaped APIs): its model,
/// one stream per choice, the prompt's length in tokens, and whether tool
/// calls are to be read out of the text.
pub struct ChatStart {
    pub model: LoadedModel,
    pub streams: Vec<GenerationStream>,
    pub prompt_tokens: usize,
    pub tools_active: bool,
}

impl ChatStart {
    /// A reader of tool calls for one choice, when the request has tools.
    pub fn call_parser(&self) -> Option<CallParser> {
        self.tools_active.then(|| self.model.engine.call_parser())
    }
}

/// Starts generating the answer to `messages` with `tools` under
/// `common`: finds the model, picks adapters, renders the chat template
/// (tools included), builds the grammar of tool calls and the response
/// format, and queues `common.n` choices.
pub async fn start_chat(
    cx: &Ctx,
    local: &Local,
    common: &validate::Common,
    messages: Vec<ChatMessage>,
    tools: ToolUse,
    params: ApiParams,
) -> Result<ChatStart, ApiError> {
    let model = cx.state.app.models.resolve(&common.model)?;
    let engine = model.engine.clone();
    // Tokens first: the adapter selector sees the prompt's length. Routing
    // may have counted them already with this model.
    let (ids, tools) = match local.counted_for(&model.id) {
        Some(ids) => (ids, tools),
        None => {
            let engine = engine.clone();
            let tokenize = move || Ok((engine.chat_tokens(&messages, &tools)?, tools));
            start_blocking(cx, tokenize, params).await?
        }
    };
    let prompt_tokens = ids.len();
    let mut request = generate_request(cx, local, Prompt::Tokens(ids), common, &model).await?;
    let (n, tools_active) = (common.n, tools.active());
    let mut streams = start_blocking(
        cx,
        move || {
            request.grammar = engine.output_grammar(&tools, request.grammar.as_ref())?;
            engine.generate_n(request, n)
        },
        params,
    )
    .await?;
    local.meter.watch(&mut streams);
    Ok(ChatStart {
        model,
        streams,
        prompt_tokens,
        tools_active,
    })
}

/// Runs `start` (chat template, tokenization, validation, queueing) on a
/// blocking thread: a long prompt takes a while to tokenize and must not
/// stall the async workers serving other requests. At most one prompt per
/// core is prepared at a time (the others wait here, holding no thread), so
/// a burst of long prompts costs bounded threads and memory.
pub async fn start_blocking<F, T>(
    cx: &Ctx,
    start: F,
    params: impl Into<ApiParams>,
) -> Result<T, ApiError>
where
    F: FnOnce() -> Result<T, EngineError> + Send + 'static,
    T: Send + 'static,
{
    // The permit moves into the task: a client that leaves while its prompt
    // is being tokenized does not free a slot before the work ends.
    let permit = Arc::clone(&cx.state.preparing)
        .acquire_owned()
        .await
        .map_err(|e| ApiError::Internal(format!("preparing the prompt failed: {e}")))?;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        start()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("preparing the prompt failed: {e}")))?
    .map_err(|e| ApiError::from_engine_in(e, params.into()))
}

/// Every choice's events as one stream, each tagged with its choice's
/// index, in the order they come; owning the streams, so dropping this
/// cancels them all.
pub fn merged(
    streams: Vec<GenerationStream>,
) -> impl Stream<Item = (usize, Result<GenerateEvent, EngineError>)> + Send + 'static {
    futures_util::stream::select_all(
        streams
            .into_iter()
            .enumerate()
            .map(|(index, stream)| events(stream).map(move |e| (index, e)).boxed()),
    )
}

/// Reads every choice to its end (concurrently: they decode in one batch).
pub async fn collect_all(
    streams: Vec<GenerationStream>,
    keep_tokens: bool,
) -> Result<Vec<Collected>, EngineError> {
    futures_util::future::try_join_all(streams.into_iter().map(|s| collect(events(s), keep_tokens)))
        .await
}

/// The usage of all choices: the prompt once, completions summed.
pub fn total_usage(choices: &[Collected]) -> Usage {
    choices
        .iter()
        .map(|c| c.usage)
        .reduce(Usage::with_choice)
        .unwrap_or_default()
}

/// The engine's stream as a `Stream`; owning it, so dropping this cancels.
pub fn events(
    stream: GenerationStream,
) -> impl Stream<Item = Result<GenerateEvent, EngineError>> + Send + 'static {
    futures_util::stream::unfold(stream, |mut s| async move {
        let event = s.next().await?;
        Some((event, s))
    })
}

/// Identifies this server build in responses (`system_fingerprint`).
pub fn system_fingerprint() -> String {
    format!("fp_mlxgate_{}", env!("CARGO_PKG_VERSION"))
}

/// A whole generation, for a non-streamed response.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    pub text: String,
    /// Filled only when logprobs were asked for.
    pub tokens: Vec<TokenOutput>,
    pub reason: FinishReason,
    pub usage: Usage,
}

/// Reads `events` to the end. A stream that stops without `Finished` is an
/// internal error.
pub async fn collect<S>(events: S, keep_tokens: bool) -> Result<Collected, EngineError>
where
    S: Stream<Item = Result<GenerateEvent, EngineError>>,
{
    let mut events = std::pin::pin!(events);
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(event) = events.next().await {
        match event? {
            GenerateEvent::Delta {
                text: t,
                tokens: ts,
                ..
            } => {
                text.push_str(&t);
                if keep_tokens {
                    tokens.extend(ts);
                }
            }
            GenerateEvent::Finished { reason, usage } => {
                return Ok(Collected {
                    text,
                    tokens,
                    reason,
                    usage,
                });
            }
        }
    }
    Err(EngineError::Internal(
        "the generation ended without a finish reason".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collect_joins_deltas() {
        let tok = |t: &str| TokenOutput {
            id: 1,
            text: t.into(),
            logprob: None,
            top_logprobs: vec![],
        };
        let events = futures_util::stream::iter(vec![
            Ok(GenerateEvent::Delta {
                text: "a".into(),
                tokens: vec![tok("a")],
                generated: 1,
            }),
            Ok(GenerateEvent::Delta {
                text: "b".into(),
                tokens: vec![tok("b")],
                generated: 2,
            }),
            Ok(GenerateEvent::Finished {
                reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: 1,
                    completion_tokens: 2,
                    cached_tokens: 0,
                },
            }),
        ]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let c = rt.block_on(collect(events, true)).unwrap();
        assert_eq!(c.text, "ab");
        assert_eq!(c.tokens.len(), 2);
        assert_eq!(c.reason, FinishReason::Length);

        let cut = futures_util::stream::iter(vec![Ok(GenerateEvent::Delta {
            text: "a".into(),
            tokens: vec![],
            generated: 1,
        })]);
        assert!(rt.block_on(collect(cut, false)).is_err());
    }
}
