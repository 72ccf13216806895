//! The prompt's length in tokens before routing, for routers that read
//! `prompt_tokens`.
//!
//! For a model served here the count is exact: the body is read as its
//! endpoint reads it, rendered with the model's chat template (tools
//! included) and tokenized with its tokenizer, and the token ids are kept
//! so the handler's prefill does not tokenize the prompt again
//! ([`Counted`], taken back by [`Local::counted_for`]). For a model not
//! served here (an upstream's), or a body the endpoint would refuse, it is
//! an estimate: the body's length in bytes over
//! [`BYTES_PER_TOKEN_ESTIMATE`], rounded up, which is the rule of thumb for
//! English text and JSON with common BPE vocabularies.

use serde_json::Value;

use super::openai::{start_blocking, validate::Endpoint};
use super::routing::Local;
use super::{Ctx, anthropic, body, openai, responses};
use crate::engine::{ChatMessage, Prompt, ToolUse};

/// Bytes per token of the estimate for models not served here.
pub const BYTES_PER_TOKEN_ESTIMATE: usize = 4;

/// A prompt tokenized for the router by `model`, reused for its prefill
/// when the request is served by that model.
pub struct Counted {
    pub model: String,
    pub ids: Vec<u32>,
}

impl Local {
    /// The prompt's token ids when routing counted them with `model`.
    pub fn counted_for(&self, model: &str) -> Option<Vec<u32>> {
        self.counted
            .as_ref()
            .filter(|c| c.model == model)
            .map(|c| c.ids.clone())
    }
}

/// What a body asks the model to read.
enum PromptInput {
    Chat(Vec<ChatMessage>, ToolUse),
    Text(Prompt),
}

/// The prompt's length in tokens for a request to `model` with body
/// `bytes`, and the ids when they were counted exactly.
pub async fn prompt_tokens(
    cx: &Ctx,
    endpoint: Endpoint,
    bytes: &[u8],
    head: &http::request::Parts,
    model: &str,
) -> (u32, Option<Counted>) {
    let estimate = bytes.len().div_ceil(BYTES_PER_TOKEN_ESTIMATE);
    let estimate = (u32::try_from(estimate).unwrap_or(u32::MAX), None);
    let Ok(loaded) = cx.state.app.models.resolve(model) else {
        return estimate;
    };
    let Some(input) = body::parse_json(bytes)
        .ok()
        .and_then(|json| prompt_input(cx, endpoint, &json, head))
    else {
        return estimate;
    };
    let engine = loaded.engine.clone();
    let ids = start_blocking(
        cx,
        move || match input {
            PromptInput::Chat(messages, tools) => engine.chat_tokens(&messages, &tools),
            PromptInput::Text(prompt) => engine.prompt_tokens(prompt),
        },
        "messages",
    )
    .await;
    match ids {
        Ok(ids) => (
            u32::try_from(ids.len()).unwrap_or(u32::MAX),
            Some(Counted {
                model: loaded.id,
                ids,
            }),
        ),
        // The handler reports what is wrong with the prompt, if it is
        // served here.
        Err(_) => estimate,
    }
}

/// The prompt of `json` as `endpoint`'s handler reads it; `None` when the
/// handler would refuse the body.
fn prompt_input(
    cx: &Ctx,
    endpoint: Endpoint,
    json: &Value,
    head: &http::request::Parts,
) -> Option<PromptInput> {
    match endpoint {
        Endpoint::Chat => openai::validate::chat_request(json)
            .ok()
            .map(|c| PromptInput::Chat(c.messages, c.tools)),
        Endpoint::Completions => openai::validate::completion_request(json)
            .ok()
            .map(|c| PromptInput::Text(c.prompt)),
        Endpoint::Messages => anthropic::validate::messages_request(json, false)
            .ok()
            .map(|m| PromptInput::Chat(m.messages, m.tools)),
        Endpoint::Embeddings => None,
        Endpoint::Responses => {
            let r = responses::validate::responses_request(json).ok()?;
            let owner = responses::tenant(head.extensions.get());
            let conversation = responses::conversation(cx, &r, &owner).ok()?;
            let messages = responses::chat_messages(&r, &conversation);
            Some(PromptInput::Chat(messages, r.tools))
        }
    }
}
