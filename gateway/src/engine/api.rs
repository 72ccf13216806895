//! The engine's public surface: plain Rust types, no MLX and no HTTP. The HTTP
//! layer builds a [`GenerateRequest`], hands it to an `EngineHandle` and reads
//! [`GenerateEvent`]s back; dropping the stream cancels the generation and
//! frees its KV cache.

use std::collections::BTreeMap;

/// One chat message as the chat template sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The calls an assistant turn made (`role: "assistant"`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `role: "tool"` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of plain text.
    pub fn text(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_owned(),
            content: content.to_owned(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A function the model may call: its name, what it does, and a JSON
/// Schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema (an object schema); `{}` when the tool takes anything.
    pub parameters: serde_json::Value,
}

/// Whether and which tools the model may call (OpenAI's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// Text or calls, as the model chooses.
    #[default]
    Auto,
    /// Text only: the tools are left out of the prompt.
    None,
    /// At least one call, to any tool.
    Required,
    /// One call to this tool.
    Function(String),
}

/// The tools of a chat request and how they may be used (`Default`: none).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolUse {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call per turn allowed (`parallel_tool_calls`).
    pub parallel: bool,
}

impl ToolChoice {
    /// OpenAI's name for the choice (`function` for a named tool).
    pub fn kind(&self) -> &'static str {
        match self {
            ToolChoice::Auto => "auto",
            ToolChoice::None => "none",
            ToolChoice::Required => "required",
            ToolChoice::Function(_) => "function",
        }
    }
}

impl ToolUse {
    /// Whether the model is told of the tools and may call them.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }
}

/// One call the model made: `arguments` is JSON text (an object).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// What to continue: text (tokenized by the engine) or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// Sampling settings with OpenAI's semantics; `Default` is greedy-free
/// sampling at temperature 1 with every filter off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 keeps everything.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Drop tokens below `min_p` x the top probability; 0 keeps all.
    pub min_p: f32,
    /// Same seed, same request: same output.
    pub seed: Option<u64>,
    /// OpenAI penalties in [-2, 2], applied to logits of tokens already generated.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Multiplicative (CTRL-style) penalty over prompt and output tokens; 1 is off.
    pub repetition_penalty: f32,
    /// Added to the logits of the given token ids (OpenAI `logit_bias`).
    pub logit_bias: BTreeMap<u32, f32>,
    /// Never end at the model's end-of-sequence tokens, only at
    /// `max_tokens` or a stop string (`ignore_eos`, as vLLM and llama.cpp's
    /// server take it: load tests want outputs of a set length). A grammar
    /// still ends its output.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            ignore_eos: false,
            logit_bias: BTreeMap::new(),
        }
    }
}

/// A grammar the output must match, enforced token by token
/// (`engine/constrain.rs`).
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON document valid under this JSON Schema.
    JsonSchema(serde_json::Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (whole).
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's dialect).
    Lark(String),
    /// A Lark grammar built from a request's tools ([`super::tools`]):
    /// its errors name `tools`, not the response format.
    ToolCalls(String),
}

impl Grammar {
    /// The `response_format` type that asks for it.
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonSchema(_) => "json_schema",
            Grammar::JsonObject => "json_object",
            Grammar::Regex(_) => "regex",
            Grammar::Lark(_) => "lark",
            Grammar::ToolCalls(_) => "tools",
        }
    }
}

/// One generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Most tokens to generate; `None` means up to the context length.
    pub max_tokens: Option<usize>,
    /// Up to 4 strings; generation ends before the first one and it is not emitted.
    pub stop: Vec<String>,
    /// `None`: no logprobs. `Some(n)`: the chosen token's logprob plus the top n (n <= 20).
    pub logprobs: Option<usize>,
    /// A named prompt cache file to start from (its tokens must begin the prompt).
    pub prompt_cache: Option<String>,
    /// Mounted LoRA adapters to apply, stacked in this order (empty: base model).
    pub adapters: Vec<String>,
    /// Whose prompt caches this request may reuse and who owns what it
    /// caches (the HTTP layer sets the caller's tenant).
    pub cache_scope: super::prompt_cache::CacheScope,
    /// Constrains the output to this grammar (`None`: free text).
    pub grammar: Option<Grammar>,
    /// Its class when requests wait to start: higher first (a router
    /// policy's choice; 0 by default). Fairness between tenants holds
    /// within a class.
    pub priority: i8,
}

impl GenerateRequest {
    /// Greedy decoding of `prompt` for up to `max_tokens`, nothing else set:
    /// the request tests, benchmarks and reference checks make.
    pub fn greedy(prompt: Prompt, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            max_tokens: Some(max_tokens),
            stop: vec![],
            logprobs: None,
            prompt_cache: None,
            adapters: vec![],
            cache_scope: super::prompt_cache::CacheScope::operator(),
            grammar: None,
            priority: 0,
        }
    }

    /// The same request with these token ids never chosen (logit bias -100),
    /// e.g. end-of-sequence ids so a benchmark decodes exactly `max_tokens`.
    pub fn suppressing(mut self, ids: &[u32]) -> GenerateRequest {
        self.sampling
            .logit_bias
            .extend(ids.iter().map(|&id| (id, -100.0)));
        self
    }
}

/// A generated token, with logprobs when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    pub id: u32,
    /// The token's text (may be a partial UTF-8 sequence shown lossily).
    pub text: String,
    pub logprob: Option<f32>,
    /// The most likely alternatives at this step, most likely first.
    pub top_logprobs: Vec<(String, f32)>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token.
    Stop,
    /// The request's stop string of this index (in `GenerateRequest::stop`,
    /// empty strings left out).
    StopString(usize),
    /// `max_tokens` or the context length.
    Length,
}

impl FinishReason {
    /// OpenAI's `finish_reason`: both kinds of stop are `stop`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString(_) => "stop",
            FinishReason::Length => "length",
        }
    }

    /// Whether the model (or a stop string) ended the answer, not a limit.
    pub fn stopped(self) -> bool {
        matches!(self, FinishReason::Stop | FinishReason::StopString(_))
    }
}

/// Token counts for OpenAI's `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from a prompt cache instead of prefilled.
    pub cached_tokens: usize,
}

impl Usage {
    /// The usage of a request with one more choice (`n` > 1): the prompt
    /// counts once, completions add up.
    pub fn with_choice(self, other: Usage) -> Usage {
        Usage {
            completion_tokens: self.completion_tokens + other.completion_tokens,
            ..self
        }
    }
}

/// What a generation stream yields, in order: any number of `Delta`s, then
/// exactly one `Finished` (or an error).
#[derive(Debug, Clone, PartialEq)]
pub enum GenerateEvent {
    /// Text safe to show (never part of a stop string), and the tokens it
    /// came from (with logprobs only); `generated` counts the choice's
    /// tokens so far, shown or held back (token accounting).
    Delta {
        text: String,
        tokens: Vec<TokenOutput>,
        generated: usize,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
}

/// What clients see of a served model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCard {
    pub id: String,
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    /// Width of the hidden state (what last-token embeddings have).
    pub hidden_size: usize,
    /// Longest prompt text, in bytes, that could fit the context: the
    /// context length times the longest vocabulary entry. Longer text is
    /// refused without tokenizing it (tokenizing megabytes costs seconds
    /// and hundreds of MB only to learn that it does not fit).
    pub max_prompt_bytes: usize,
}

/// Engine failures; the HTTP layer maps each to a status once.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EngineError {
    /// Prompt plus requested tokens do not fit (OpenAI `context_length_exceeded`).
    #[error(
        "This model's maximum context length is {context_length} tokens. However, you requested {requested} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion."
    )]
    ContextLengthExceeded {
        context_length: usize,
        prompt_tokens: usize,
        max_tokens: usize,
        requested: usize,
    },
    /// The prompt text is longer than any text that fits the context
    /// ([`ModelCard::max_prompt_bytes`]); found before tokenizing.
    #[error(
        "This model's maximum context length is {context_length} tokens, which no text longer than {max_bytes} bytes fits; the prompt is {bytes} bytes (refused before tokenizing). Please reduce the length of the messages or prompt."
    )]
    PromptTooLong {
        context_length: usize,
        bytes: usize,
        max_bytes: usize,
    },
    /// The prompt is unusable (empty, or a token id outside the vocabulary).
    #[error("{0}")]
    InvalidPrompt(String),
    /// The chat template failed to render these messages.
    #[error("chat template error: {0}")]
    Template(String),
    /// The engine thread has stopped (shutdown or a fatal MLX error).
    #[error("the model engine is not running")]
    Unavailable,
    /// The model is split over processes and their group cannot serve now
    /// (a worker was lost, or has not connected yet): why.
    #[error("the model's process group cannot serve: {0}")]
    ProcessGroup(String),
    /// The model's queue is full (`[scheduler] max_queued`).
    #[error(
        "The model is overloaded: {waiting} requests are already waiting. Retry after {} s (the Retry-After header), or send fewer requests at once.", retry_after.as_secs()
    )]
    Overloaded {
        waiting: usize,
        retry_after: std::time::Duration,
    },
    /// The caller's tenant already fills its share of the model's queue
    /// (`[scheduler] tenant_queue_share`).
    #[error(
        "Your tenant already has {limit} requests waiting for this model, its share of the queue. Wait for some to start and retry after {} s (the Retry-After header).", retry_after.as_secs()
    )]
    TenantQueueFull {
        limit: usize,
        retry_after: std::time::Duration,
    },
    /// MLX or tokenizer failure during generation.
    #[error("generation failed: {0}")]
    Internal(String),
    /// No prompt cache of that name exists.
    #[error("there is no prompt cache named `{0}`; GET /v1/prompt_caches lists them")]
    PromptCacheNotFound(String),
    /// The named prompt cache cannot serve this request (other model, no
    /// shared prefix, or a damaged file).
    #[error("{0}")]
    PromptCache(String),
    /// A request named an adapter that is not mounted.
    #[error("unknown adapter `{requested}`; mounted: {}", if mounted.is_empty() { "(none)".to_owned() } else { mounted.join(", ") })]
    UnknownAdapter {
        requested: String,
        mounted: Vec<String>,
    },
    /// An adapter could not be mounted (the message names the module and
    /// what is wrong).
    #[error("{0}")]
    Adapter(String),
    /// The request's grammar (a JSON Schema, a regex...) cannot be
    /// compiled; the message says what in it.
    #[error("{0}")]
    Grammar(String),
    /// A tool's parameters schema cannot be compiled into a grammar.
    #[error("{0}")]
    ToolSchema(String),
}
