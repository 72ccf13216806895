//! Request validation for `/v1/chat/completions` and `/v1/completions`.
//!
//! Bodies are parsed to a `serde_json::Value` first and then read field by
//! field, so that every mistake (wrong type, out of range, missing, not
//! supported) becomes a 400 that names the offending field in `param`, in
//! OpenAI's wording, instead of serde's positional messages. Unknown fields
//! are ignored, as OpenAI does; `null` counts as absent.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::engine::{ChatMessage, Grammar, Prompt, SamplingParams, ToolUse};
use crate::engine::lora;
use crate::http::ApiError;
use crate::http::body::Picked;

/// Most stop sequences OpenAI accepts.
pub const MAX_STOP: usize = 4;
/// Longest stop sequence, in bytes. The stop filter compares held text with
/// each stop sequence at every token, so its cost grows with their length.
pub const MAX_STOP_BYTES: usize = 256;
/// Longest `model`, in bytes: no served or upstream model id is longer, and
/// the model name is a routing fact that policies and their decision tables
/// keep.
pub const MAX_MODEL_BYTES: usize = 256;
/// Most `logit_bias` entries (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Most `top_logprobs` for chat.
pub const MAX_TOP_LOGPROBS: u64 = 20;
/// Most `logprobs` for completions.
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;
/// Most choices (`n`) one request may ask for: each is a sequence in the
/// model's batch.
pub const MAX_CHOICES: u64 = 8;
/// OpenAI's default `max_tokens` for the legacy completions endpoint.
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// The fields both endpoints share, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    pub model: String,
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `Some(n)`: the chosen token's logprob plus the top n alternatives.
    pub logprobs: Option<usize>,
    /// mlxgate extension: start from this named prompt cache.
    pub prompt_cache: Option<String>,
    /// mlxgate extension: LoRA adapters to apply (`a`, `a+b`, `a,b`, `none`),
    /// split and checked (at most `lora::MAX_STACK`, each once).
    pub adapter: Option<Vec<String>>,
    /// `response_format`: the grammar the output must match (`None`: text).
    pub grammar: Option<Grammar>,
    /// Choices to generate (`n`), from one prefill.
    pub n: usize,
    /// [`RoutingFields::features`], for adapter selectors.
    pub features: String,
}

/// A validated `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub common: Common,
    pub messages: Vec<ChatMessage>,
    /// `tools`, `tool_choice` and `parallel_tool_calls`.
    pub tools: ToolUse,
}

/// A validated `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompt: Prompt,
}

/// The endpoints whose bodies are routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// Anthropic's `/v1/messages` (`http/anthropic`).
    Messages,
    /// OpenAI's `/v1/responses` (`http/responses`).
    Responses,
    /// `/v1/embeddings`: proxied to upstreams (no local embedding models).
    Embeddings,
}

/// What routing reads from a body (and a router policy sees): read by the
/// same field readers, with the same defaults, as [`chat_request`] and
/// [`completion_request`], so the request a policy decides on is the
/// request served. A body these cannot read is refused before routing.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingFields<'a> {
    pub model: &'a str,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    /// The endpoint's tools (none for completions), read once here for
    /// the policy's facts and the request served alike.
    pub tools: ToolUse,
    /// The endpoint's output format (`response_format`, `text.format`,
    /// `output_config.format`).
    pub format: Option<Grammar>,
    /// Choices (`n`; always 1 outside OpenAI's chat and completions).
    pub n: usize,
    /// What the request asks of the model beyond text, as policies see it
    /// in the `x-mlxgate-features` header ([`features`]).
    pub features: String,
}

/// The top-level fields [`routing_fields`] reads, and nothing else.
pub const ROUTING_FIELDS: [&str; 12] = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "n",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    // `/v1/responses`' token budget and output format.
    "max_output_tokens",
    "text",
    // `/v1/messages`' output format.
    "output_config",
];

pub fn routing_fields(body: &Value, endpoint: Endpoint) -> Result<RoutingFields<'_>, ApiError> {
    read_routing(&Fields::of(body)?, endpoint)
}

/// [`routing_fields`] of the routing fields alone, as routing picks them
/// from a body ([`crate::http::body::pick_json_fields`] with
/// [`ROUTING_FIELDS`]): the same readers over the same values.
pub fn picked_routing_fields(
    picked: &Picked<{ ROUTING_FIELDS.len() }>,
    endpoint: Endpoint,
) -> Result<RoutingFields<'_>, ApiError> {
    let f = match picked {
        Picked::Object(values) => Fields {
            obj: Object::Picked(&ROUTING_FIELDS, values),
        },
        Picked::NotObject(body) => Fields::of(body)?,
    };
    read_routing(&f, endpoint)
}

pub(crate) fn read_routing<'a>(
    f: &Fields<'a>,
    endpoint: Endpoint,
) -> Result<RoutingFields<'a>, ApiError> {
    let (model, max_tokens) = (model(f)?, max_tokens(f, endpoint)?);
    let stream = f.bool("stream")?.unwrap_or(false);
    let tools = match endpoint {
        Endpoint::Chat => super::tools::tool_use(f)?,
        Endpoint::Messages => crate::http::anthropic::validate::tool_use(f)?,
        Endpoint::Responses => crate::http::responses::validate::tool_use(f)?,
        Endpoint::Completions | Endpoint::Embeddings => ToolUse::default(),
    };
    let format = match endpoint {
        Endpoint::Messages => crate::http::anthropic::validate::output_format(f)?,
        Endpoint::Responses => crate::http::responses::validate::text_format(f)?,
        Endpoint::Chat | Endpoint::Completions => response_format(f)?,
        Endpoint::Embeddings => None,
    };
    let n = match endpoint {
        Endpoint::Chat | Endpoint::Completions => choices(f)?,
        Endpoint::Messages | Endpoint::Responses | Endpoint::Embeddings => 1,
    };
    Ok(RoutingFields {
        model,
        max_tokens,
        stream,
        features: features(&tools, format.as_ref(), n),
        tools,
        format,
        n,
    })
}

/// The request's features beyond plain text, comma-separated, for the
/// synthetic `x-mlxgate-features` header router and adapter policies see
/// (a header, not a new WIT field, so guests built for `policy@0.3.0`
/// keep working): `tools=<count>` and `tool_choice=<auto|none|required|
/// function>` when tools are listed, `response_format=<json_schema|
/// json_object|regex|lark>`, `n=<choices>` when above 1. Empty for a
/// plain request. Read by the same readers as the request served.
fn features(tools: &ToolUse, format: Option<&Grammar>, n: usize) -> String {
    let mut out = Vec::new();
    if !tools.tools.is_empty() {
        out.push(format!("tools={}", tools.tools.len()));
        out.push(format!("tool_choice={}", tools.choice.kind()));
    }
    if let Some(grammar) = format {
        out.push(format!("response_format={}", grammar.kind()));
    }
    if n > 1 {
        out.push(format!("n={n}"));
    }
    out.join(",")
}

/// `n`: how many choices, 1 to [`MAX_CHOICES`].
fn choices(f: &Fields) -> Result<usize, ApiError> {
    Ok(f.int_in("n", 1, MAX_CHOICES)?.unwrap_or(1) as usize)
}

/// `model`: required, not empty, at most [`MAX_MODEL_BYTES`].
fn model<'a>(f: &Fields<'a>) -> Result<&'a str, ApiError> {
    let model = f.string("model")?.ok_or_else(|| missing("model"))?;
    if model.is_empty() {
        return Err(invalid(
            "model",
            "invalid_value",
            "Invalid 'model': empty string. Expected the id of a model (see GET /v1/models).",
        ));
    }
    if model.len() > MAX_MODEL_BYTES {
        return Err(invalid(
            "model",
            "string_above_max_length",
            &format!(
                "Invalid 'model': string too long. Expected at most {MAX_MODEL_BYTES} bytes, but got {} instead; send the id of a model (see GET /v1/models).",
                model.len()
            ),
        ));
    }
    Ok(model)
}

/// The completion's token budget: chat's `max_completion_tokens` replaces
/// the deprecated `max_tokens`; completions default to OpenAI's 16.
fn max_tokens(f: &Fields, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    let max_tokens = f.positive_int("max_tokens")?;
    Ok(match endpoint {
        Endpoint::Chat => f.positive_int("max_completion_tokens")?.or(max_tokens),
        Endpoint::Completions => max_tokens.or(Some(DEFAULT_COMPLETION_MAX_TOKENS)),
        // Required: the Messages reader says so in Anthropic's words.
        Endpoint::Messages => max_tokens,
        Endpoint::Responses => f.positive_int("max_output_tokens")?,
        Endpoint::Embeddings => None,
    })
}

pub fn chat_request(body: &Value) -> Result<ChatRequest, ApiError> {
    let f = Fields::of(body)?;
    let messages = messages(&f)?;
    let (mut common, tools) = common(&f, Endpoint::Chat)?;
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top = f.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS)?;
    common.logprobs = match (logprobs, top) {
        (true, top) => Some(top.unwrap_or(0) as usize),
        (false, None) => None,
        (false, Some(_)) => {
            return Err(invalid(
                "top_logprobs",
                "invalid_value",
                "Invalid value for 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is used.",
            ));
        }
    };
    super::tools::check_tool_results(&messages)?;
    Ok(ChatRequest {
        common,
        messages,
        tools,
    })
}

pub fn completion_request(body: &Value) -> Result<CompletionRequest, ApiError> {
    let f = Fields::of(body)?;
    let prompt = prompt(&f)?;
    let (mut common, _) = common(&f, Endpoint::Completions)?;
    common.logprobs = f
        .int_in("logprobs", 0, MAX_COMPLETION_LOGPROBS)?
        .map(|n| n as usize);
    if f.bool("echo")?.unwrap_or(false) {
        return Err(unsupported("echo", "'echo' is not supported."));
    }
    if f.positive_int("best_of")?.is_some_and(|n| n > 1) {
        return Err(unsupported(
            "best_of",
            "best_of > 1 is not supported; send best_of = 1 or leave it out.",
        ));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix", "'suffix' is not supported."));
    }
    Ok(CompletionRequest { common, prompt })
}

/// A validated `POST /v1/prompt_caches`.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveCacheRequest {
    pub name: String,
    pub model: String,
    pub content: CacheContent,
}

/// What a saved prompt cache holds.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheContent {
    /// Text or token ids, as in `/v1/completions`.
    Prompt(Prompt),
    /// Chat messages, rendered by the model's template without the
    /// assistant turn's opening, so a later conversation extends them.
    Messages(Vec<ChatMessage>),
}

pub fn save_cache_request(body: &Value) -> Result<SaveCacheRequest, ApiError> {
    let f = Fields::of(body)?;
    let name = f.string("name")?.ok_or_else(|| missing("name"))?;
    crate::engine::prompt_cache::store::validate_new_name(name)
        .map_err(|message| invalid("name", "invalid_value", &message))?;
    let model = f.string("model")?.ok_or_else(|| missing("model"))?;
    let content = match (f.get("prompt"), f.get("messages")) {
        (Some(_), None) => CacheContent::Prompt(prompt(&f)?),
        (None, Some(_)) => CacheContent::Messages(messages(&f)?),
        (Some(_), Some(_)) => {
            return Err(invalid(
                "messages",
                "invalid_value",
                "Give either 'prompt' or 'messages', not both.",
            ));
        }
        (None, None) => return Err(missing("prompt")),
    };
    Ok(SaveCacheRequest {
        name: name.to_owned(),
        model: model.to_owned(),
        content,
    })
}

/// The fields both endpoints share, and the tools (none for completions).
fn common(f: &Fields, endpoint: Endpoint) -> Result<(Common, ToolUse), ApiError> {
    let RoutingFields {
        model,
        max_tokens,
        stream,
        tools,
        format,
        n,
        features,
    } = read_routing(f, endpoint)?;
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(invalid(
                "stream_options",
                "invalid_value",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            ));
        }
        Some(Value::Object(opts)) => match opts.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(wrong_type("stream_options.include_usage", "boolean", other));
            }
        },
        Some(other) => return Err(wrong_type("stream_options", "object", other)),
    };

    let d = basic_sampling(f, 2.0)?;
    let sampling = SamplingParams {
        top_k: top_k(f)?,
        min_p: f
            .number_in("min_p", Bound::Incl(0.0), Bound::Incl(1.0))?
            .unwrap_or(d.min_p),
        seed: f.int("seed")?.map(|s| s as u64),
        presence_penalty: f
            .number_in("presence_penalty", Bound::Incl(-2.0), Bound::Incl(2.0))?
            .unwrap_or(d.presence_penalty),
        frequency_penalty: f
            .number_in("frequency_penalty", Bound::Incl(-2.0), Bound::Incl(2.0))?
            .unwrap_or(d.frequency_penalty),
        repetition_penalty: f
            .number_in("repetition_penalty", Bound::Excl(0.0), Bound::None)?
            .unwrap_or(d.repetition_penalty),
        logit_bias: logit_bias(f)?,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        ..d
    };
    Ok((
        Common {
            model: model.to_owned(),
            sampling,
            max_tokens,
            stop: stop(f)?,
            stream,
            include_usage,
            logprobs: None,
            prompt_cache: prompt_cache(f)?,
            adapter: adapter(f)?,
            grammar: format,
            n,
            features,
        },
        tools,
    ))
}

/// `temperature` (0 to `max_temperature`: 2 for OpenAI, 1 for Anthropic)
/// and `top_p`, the rest of the sampling settings at their defaults.
pub(crate) fn basic_sampling(f: &Fields, max_temperature: f64) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    Ok(SamplingParams {
        temperature: f
            .number_in(
                "temperature",
                Bound::Incl(0.0),
                Bound::Incl(max_temperature),
            )?
            .unwrap_or(d.temperature),
        top_p: f
            .number_in("top_p", Bound::Excl(0.0), Bound::Incl(1.0))?
            .unwrap_or(d.top_p),
        ..d
    })
}

/// `response_format`: `text`, `json_object`, `json_schema` (OpenAI's
/// shapes) or, as mlxgate extensions, `regex` (`{"type": "regex", "regex":
/// "..."}`) and `lark` (`{"type": "lark", "lark": "..."}`). Whether the
/// schema, regex or grammar compiles is the engine's to say.
fn response_format(f: &Fields) -> Result<Option<Grammar>, ApiError> {
    let Some(format) = f.get("response_format") else {
        return Ok(None);
    };
    let Value::Object(format) = format else {
        return Err(wrong_type("response_format", "object", format));
    };
    let text = |key: &str| -> Result<String, ApiError> {
        let param = format!("response_format.{key}");
        match format.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            None | Some(Value::Null) => Err(missing(&param)),
            Some(other) => Err(wrong_type(&param, "string", other)),
        }
    };
    match text("type")?.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some(Grammar::JsonObject)),
        "json_schema" => {
            json_schema_spec(format.get("json_schema"), "response_format.json_schema").map(Some)
        }
        "regex" => Ok(Some(Grammar::Regex(text("regex")?))),
        "lark" => Ok(Some(Grammar::Lark(text("lark")?))),
        other => Err(invalid(
            "response_format.type",
            "invalid_value",
            &format!(
                "Invalid value: '{other}'. Supported values are: 'text', 'json_object', 'json_schema', and the mlxgate extensions 'regex' and 'lark'."
            ),
        )),
    }
}

/// `response_format.json_schema` (or, flat, `/v1/responses`' `text.format`):
/// `{name, schema, strict?, description?}`; `param` names it in errors.
pub(crate) fn json_schema_spec(spec: Option<&Value>, param: &str) -> Result<Grammar, ApiError> {
    let spec = match spec {
        None | Some(Value::Null) => return Err(missing(param)),
        Some(Value::Object(spec)) => spec,
        Some(other) => return Err(wrong_type(param, "object", other)),
    };
    let name_param = format!("{param}.name");
    match spec.get("name") {
        Some(Value::String(name))
            if !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => {}
        Some(Value::String(_)) => {
            return Err(invalid(
                &name_param,
                "invalid_value",
                &format!(
                    "Invalid '{name_param}': use 1 to 64 letters, digits, underscores or dashes."
                ),
            ));
        }
        None | Some(Value::Null) => return Err(missing(&name_param)),
        Some(other) => return Err(wrong_type(&name_param, "string", other)),
    }
    if let Some(strict) = spec.get("strict")
        && !strict.is_null()
        && !strict.is_boolean()
    {
        return Err(wrong_type(&format!("{param}.strict"), "boolean", strict));
    }
    match spec.get("schema") {
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
            Ok(Grammar::JsonSchema(schema.clone()))
        }
        // No schema: any JSON object.
        None | Some(Value::Null) => Ok(Grammar::JsonObject),
        Some(other) => Err(wrong_type(&format!("{param}.schema"), "object", other)),
    }
}

/// `adapter`: the stack to run with (see [`lora::parse_spec`]).
pub(crate) fn adapter(f: &Fields) -> Result<Option<Vec<String>>, ApiError> {
    f.string("adapter")?
        .map(|spec| {
            lora::parse_spec(spec).map_err(|message| {
                invalid(
                    "adapter",
                    "invalid_value",
                    &format!("Invalid 'adapter': {message}."),
                )
            })
        })
        .transpose()
}

/// `prompt_cache`: the name of a saved prompt cache (`null` means none).
pub(crate) fn prompt_cache(f: &Fields) -> Result<Option<String>, ApiError> {
    let Some(name) = f.string("prompt_cache")? else {
        return Ok(None);
    };
    crate::engine::prompt_cache::store::validate_name(name)
        .map_err(|message| invalid("prompt_cache", "invalid_value", &message))?;
    Ok(Some(name.to_owned()))
}

/// `top_k`: 0 or -1 (vLLM's spelling) turn it off.
fn top_k(f: &Fields) -> Result<usize, ApiError> {
    match f.int("top_k")? {
        None | Some(-1) => Ok(0),
        Some(k) if k >= 0 => Ok(k as usize),
        Some(k) => Err(invalid(
            "top_k",
            "integer_below_min_value",
            &format!(
                "Invalid 'top_k': integer below minimum value. Expected a value >= 0 (or -1 for no limit), but got {k} instead."
            ),
        )),
    }
}

fn logit_bias(f: &Fields) -> Result<BTreeMap<u32, f32>, ApiError> {
    let mut out = BTreeMap::new();
    let Some(v) = f.get("logit_bias") else {
        return Ok(out);
    };
    let Value::Object(map) = v else {
        return Err(wrong_type("logit_bias", "object", v));
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(invalid(
            "logit_bias",
            "object_above_max_properties",
            &format!(
                "Invalid 'logit_bias': too many entries. Expected at most {MAX_LOGIT_BIAS} token ids, but got {} instead.",
                map.len()
            ),
        ));
    }
    for (k, v) in map {
        let id: u32 = k.parse().map_err(|_| {
            invalid(
                "logit_bias",
                "invalid_value",
                &format!(
                    "Invalid key in 'logit_bias': '{k}' is not a token id (a non-negative integer)."
                ),
            )
        })?;
        let param = format!("logit_bias.{k}");
        let bias = v.as_f64().ok_or_else(|| wrong_type(&param, "number", v))?;
        check_range(&param, bias, Bound::Incl(-100.0), Bound::Incl(100.0))?;
        out.insert(id, bias as f32);
    }
    Ok(out)
}

fn stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let stops = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(invalid(
                    "stop",
                    "array_above_max_length",
                    &format!(
                        "Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP}, but got an array with length {} instead.",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    s.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| wrong_type(&format!("stop[{i}]"), "string", s))
                })
                .collect::<Result<_, _>>()?
        }
        Some(other) => return Err(wrong_type("stop", "string or array of strings", other)),
    };
    if let Some((i, long)) = stops
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_BYTES)
    {
        let param = if matches!(f.get("stop"), Some(Value::Array(_))) {
            format!("stop[{i}]")
        } else {
            "stop".to_owned()
        };
        return Err(invalid(
            &param,
            "string_above_max_length",
            &format!(
                "Invalid '{param}': string too long. Expected a stop sequence of at most {MAX_STOP_BYTES} bytes, but got {} instead.",
                long.len()
            ),
        ));
    }
    // An empty stop string would end every generation at once; drop it.
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

fn messages(f: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    let v = f.get("messages").ok_or_else(|| missing("messages"))?;
    let Value::Array(items) = v else {
        return Err(wrong_type("messages", "array", v));
    };
    if items.is_empty() {
        return Err(invalid(
            "messages",
            "empty_array",
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect()
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let at = format!("messages[{i}]");
    let Value::Object(obj) = m else {
        return Err(wrong_type(&at, "object", m));
    };
    let role_param = format!("{at}.role");
    let role = match obj.get("role") {
        None | Some(Value::Null) => return Err(missing(&role_param)),
        Some(Value::String(r)) => r.as_str(),
        Some(other) => return Err(wrong_type(&role_param, "string", other)),
    };
    let role = match role {
        // Chat templates know `system`; `developer` is OpenAI's newer name for it.
        "system" | "developer" => "system",
        "user" | "assistant" | "tool" => role,
        other => {
            return Err(invalid(
                &role_param,
                "invalid_value",
                &format!(
                    "Invalid value: '{other}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."
                ),
            ));
        }
    };
    let content_param = format!("{at}.content");
    let content = match obj.get("content") {
        // An assistant turn may carry only tool calls.
        None | Some(Value::Null) if role == "assistant" => String::new(),
        None | Some(Value::Null) => return Err(missing(&content_param)),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => content_parts(&content_param, parts)?,
        Some(other) => return Err(wrong_type(&content_param, "string or array", other)),
    };
    Ok(ChatMessage {
        role: role.to_owned(),
        content,
        tool_calls: match role {
            "assistant" => super::tools::tool_calls(&at, obj)?,
            _ => Vec::new(),
        },
        tool_call_id: match role {
            "tool" => Some(super::tools::tool_call_id(&at, obj)?),
            _ => None,
        },
    })
}

/// Joins the text parts of an array `content`; other part types are refused.
fn content_parts(param: &str, parts: &[Value]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{param}[{j}]");
        let Value::Object(p) = part else {
            return Err(wrong_type(&at, "object", part));
        };
        let type_param = format!("{at}.type");
        match p.get("type") {
            Some(Value::String(t)) if t == "text" => {}
            Some(Value::String(t))
                if ["image_url", "input_image", "image"].contains(&t.as_str()) =>
            {
                return Err(unsupported(
                    &type_param,
                    "Image content is not supported: this server serves text-only models. Send text parts ({\"type\": \"text\", \"text\": ...}) only.",
                ));
            }
            Some(Value::String(t)) => {
                return Err(invalid(
                    &type_param,
                    "invalid_value",
                    &format!("Invalid value: '{t}'. Supported values are: 'text'."),
                ));
            }
            None | Some(Value::Null) => return Err(missing(&type_param)),
            Some(other) => return Err(wrong_type(&type_param, "string", other)),
        }
        let text_param = format!("{at}.text");
        match p.get("text") {
            Some(Value::String(s)) => texts.push(s.as_str()),
            None | Some(Value::Null) => return Err(missing(&text_param)),
            Some(other) => return Err(wrong_type(&text_param, "string", other)),
        }
    }
    Ok(texts.join("\n"))
}

fn prompt(f: &Fields) -> Result<Prompt, ApiError> {
    let v = f.get("prompt").ok_or_else(|| missing("prompt"))?;
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => match items.as_slice() {
            [] => Err(invalid(
                "prompt",
                "empty_array",
                "Invalid 'prompt': empty array. Expected a string, an array with one string, or an array of token ids.",
            )),
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(tokens)] => token_ids("prompt[0]", tokens).map(Prompt::Tokens),
            [Value::String(_) | Value::Array(_), _, ..] => Err(unsupported(
                "prompt",
                "Batched prompts are not supported: send one prompt per request (a string, an array with one string, or an array of token ids).",
            )),
            tokens => token_ids("prompt", tokens).map(Prompt::Tokens),
        },
        other => Err(wrong_type("prompt", "string or array", other)),
    }
}

pub(crate) fn token_ids(param: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    let at = format!("{param}[{i}]");
                    if t.is_number() {
                        invalid(
                            &at,
                            "invalid_value",
                            &format!(
                                "Invalid '{at}': {t} is not a token id (a non-negative integer)."
                            ),
                        )
                    } else {
                        wrong_type(&at, "integer", t)
                    }
                })
        })
        .collect()
}

// ---------------------------------------------------------------- field reader

/// The top-level object of a request body, read one typed field at a time.
pub(crate) struct Fields<'a> {
    obj: Object<'a>,
}

/// The object validation reads: a whole body, or only the fields routing
/// picked (names and values side by side).
#[derive(Clone, Copy)]
enum Object<'a> {
    Whole(&'a Map<String, Value>),
    Picked(&'a [&'a str], &'a [Option<Value>]),
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Bound {
    Incl(f64),
    Excl(f64),
    None,
}

impl<'a> Fields<'a> {
    pub(crate) fn of(body: &'a Value) -> Result<Self, ApiError> {
        match body {
            Value::Object(obj) => Ok(Fields {
                obj: Object::Whole(obj),
            }),
            other => Err(ApiError::InvalidRequest {
                message: format!(
                    "The request body must be a JSON object, not {}.",
                    json_kind(other)
                ),
                param: None,
            }),
        }
    }

    /// The field, with `null` read as absent.
    pub(crate) fn get(&self, name: &str) -> Option<&'a Value> {
        let value = match self.obj {
            Object::Whole(obj) => obj.get(name),
            Object::Picked(names, values) => names
                .iter()
                .position(|n| *n == name)
                .and_then(|i| values[i].as_ref()),
        };
        value.filter(|v| !v.is_null())
    }

    pub(crate) fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(wrong_type(name, "string", other)),
        }
    }

    pub(crate) fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(wrong_type(name, "boolean", other)),
        }
    }

    /// An integer; `2.0` counts, `2.5` does not.
    fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        if let Some(i) = v.as_i64() {
            return Ok(Some(i));
        }
        match v.as_f64() {
            Some(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => Ok(Some(x as i64)),
            _ => Err(wrong_type(name, "integer", v)),
        }
    }

    pub(crate) fn int_in(&self, name: &str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
        let Some(i) = self.int(name)? else {
            return Ok(None);
        };
        if i < min as i64 {
            return Err(invalid(
                name,
                "integer_below_min_value",
                &format!(
                    "Invalid '{name}': integer below minimum value. Expected a value >= {min}, but got {i} instead."
                ),
            ));
        }
        if i > max as i64 {
            return Err(invalid(
                name,
                "integer_above_max_value",
                &format!(
                    "Invalid '{name}': integer above maximum value. Expected a value <= {max}, but got {i} instead."
                ),
            ));
        }
        Ok(Some(i as u64))
    }

    pub(crate) fn positive_int(&self, name: &str) -> Result<Option<usize>, ApiError> {
        Ok(self.int_in(name, 1, u32::MAX as u64)?.map(|n| n as usize))
    }

    pub(crate) fn number_in(
        &self,
        name: &str,
        lo: Bound,
        hi: Bound,
    ) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| wrong_type(name, "number", v))?;
        check_range(name, x, lo, hi)?;
        Ok(Some(x as f32))
    }
}

fn check_range(name: &str, x: f64, lo: Bound, hi: Bound) -> Result<(), ApiError> {
    let (below, lo_text) = match lo {
        Bound::Incl(b) => (x < b, format!(">= {b}")),
        Bound::Excl(b) => (x <= b, format!("> {b}")),
        Bound::None => (false, String::new()),
    };
    if below {
        return Err(invalid(
            name,
            "decimal_below_min_value",
            &format!(
                "Invalid '{name}': decimal below minimum value. Expected a value {lo_text}, but got {x} instead."
            ),
        ));
    }
    let (above, hi_text) = match hi {
        Bound::Incl(b) => (x > b, format!("<= {b}")),
        Bound::Excl(b) => (x >= b, format!("< {b}")),
        Bound::None => (false, String::new()),
    };
    if above {
        return Err(invalid(
            name,
            "decimal_above_max_value",
            &format!(
                "Invalid '{name}': decimal above maximum value. Expected a value {hi_text}, but got {x} instead."
            ),
        ));
    }
    Ok(())
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(crate) fn invalid(param: &str, code: &'static str, message: &str) -> ApiError {
    ApiError::InvalidParam {
        message: message.to_owned(),
        param: param.to_owned(),
        code,
    }
}

pub(crate) fn unsupported(param: &str, message: &str) -> ApiError {
    invalid(param, "unsupported_value", message)
}

pub(crate) fn missing(param: &str) -> ApiError {
    invalid(
        param,
        "missing_required_parameter",
        &format!("Missing required parameter: '{param}'."),
    )
}

pub(crate) fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    invalid(
        param,
        "invalid_type",
        &format!(
            "Invalid type for '{param}': expected {expected}, but got {} instead.",
            json_kind(got)
        ),
    )
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::json;

    use super::*;

    pub(in crate::http::openai) fn chat(extra: Value) -> Value {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        if let (Value::Object(base), Value::Object(extra)) = (&mut v, extra) {
            base.extend(extra);
        }
        v
    }

    fn completion(extra: Value) -> Value {
        let mut v = json!({"model": "m", "prompt": "once upon"});
        if let (Value::Object(base), Value::Object(extra)) = (&mut v, extra) {
            base.extend(extra);
        }
        v
    }

    /// Asserts a 400 with this param and code.
    #[track_caller]
    pub(in crate::http::openai) fn rejects(
        result: Result<impl std::fmt::Debug, ApiError>,
        param: &str,
        code: &str,
    ) {
        let e = result.expect_err("should be rejected");
        assert_eq!(e.status().as_u16(), 400, "{e}");
        assert_eq!(e.error_type(), "invalid_request_error", "{e}");
        assert_eq!(e.param(), Some(param), "{e}");
        assert_eq!(e.code(), code, "{e}");
    }

    #[test]
    fn minimal_chat_gets_defaults() {
        let r = chat_request(&chat(json!({}))).unwrap();
        assert_eq!(r.common.model, "m");
        assert_eq!(r.common.sampling, SamplingParams::default());
        assert_eq!(r.common.max_tokens, None);
        assert!(r.common.stop.is_empty());
        assert!(!r.common.stream && !r.common.include_usage);
        assert_eq!(r.common.logprobs, None);
        assert_eq!(r.messages, vec![ChatMessage::text("user", "hi")]);
    }

    #[test]
    fn full_chat_is_read() {
        let r = chat_request(&chat(json!({
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "t"}
            ],
            "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
            "top_k": 40, "min_p": 0.1, "seed": 3, "presence_penalty": -2, "frequency_penalty": 2.0,
            "repetition_penalty": 1.1, "logit_bias": {"50256": -100, "7": 2.5}, "ignore_eos": true,
            "stop": ["\n", "", "END"], "n": 1, "stream": true, "stream_options": {"include_usage": true},
            "logprobs": true, "top_logprobs": 3, "user": "u", "some_future_field": {"x": 1},
            "tools": [], "response_format": {"type": "text"}
        })))
        .unwrap();
        let c = &r.common;
        assert_eq!(c.max_tokens, Some(7));
        assert_eq!(c.sampling.temperature, 0.0);
        assert_eq!(c.sampling.top_p, 0.5);
        assert_eq!(c.sampling.top_k, 40);
        assert_eq!(c.sampling.seed, Some(3));
        assert_eq!(c.sampling.presence_penalty, -2.0);
        assert_eq!(c.sampling.repetition_penalty, 1.1);
        assert!(c.sampling.ignore_eos);
        assert_eq!(c.sampling.logit_bias.get(&50256), Some(&-100.0));
        assert_eq!(c.sampling.logit_bias.get(&7), Some(&2.5));
        assert_eq!(c.stop, vec!["\n", "END"]);
        assert!(c.stream && c.include_usage);
        assert_eq!(c.logprobs, Some(3));
        let roles: Vec<_> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(r.messages[1].content, "a\nb");
        assert_eq!(r.messages[2].content, "");
    }

    #[test]
    fn nulls_count_as_absent() {
        let r = chat_request(&chat(json!({
            "temperature": null, "stop": null, "max_tokens": null, "stream_options": null, "logprobs": null
        })))
        .unwrap();
        assert_eq!(r.common.sampling, SamplingParams::default());
        assert!(r.common.stop.is_empty());
    }

    #[test]
    fn body_must_be_an_object() {
        let e = chat_request(&json!([1])).unwrap_err();
        assert_eq!((e.status().as_u16(), e.code()), (400, "invalid_request"));
        assert_eq!(e.param(), None);
        assert!(e.to_string().contains("not an array"), "{e}");
    }

    #[test]
    fn model_errors() {
        rejects(
            chat_request(&json!({"messages": [{"role": "user", "content": "x"}]})),
            "model",
            "missing_required_parameter",
        );
        rejects(
            chat_request(&chat(json!({"model": 3}))),
            "model",
            "invalid_type",
        );
        rejects(
            chat_request(&chat(json!({"model": ""}))),
            "model",
            "invalid_value",
        );
        rejects(
            completion_request(&json!({"prompt": "x"})),
            "model",
            "missing_required_parameter",
        );
    }

    #[test]
    fn message_errors() {
        rejects(
            chat_request(&json!({"model": "m"})),
            "messages",
            "missing_required_parameter",
        );
        rejects(
            chat_request(&chat(json!({"messages": "hi"}))),
            "messages",
            "invalid_type",
        );
        rejects(
            chat_request(&chat(json!({"messages": []}))),
            "messages",
            "empty_array",
        );
        rejects(
            chat_request(&chat(json!({"messages": ["hi"]}))),
            "messages[0]",
            "invalid_type",
        );
        let three = |third: Value| {
            chat(json!({"messages": [
                {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, third
            ]}))
        };
        rejects(
            chat_request(&three(json!({"role": "wizard", "content": "x"}))),
            "messages[2].role",
            "invalid_value",
        );
        rejects(
            chat_request(&three(json!({"content": "x"}))),
            "messages[2].role",
            "missing_required_parameter",
        );
        rejects(
            chat_request(&three(json!({"role": 1, "content": "x"}))),
            "messages[2].role",
            "invalid_type",
        );
        rejects(
            chat_request(&three(json!({"role": "user"}))),
            "messages[2].content",
            "missing_required_parameter",
        );
        rejects(
            chat_request(&three(json!({"role": "user", "content": 5}))),
            "messages[2].content",
            "invalid_type",
        );
        rejects(
            chat_request(&three(
                json!({"role": "assistant", "content": null, "tool_calls": [{}]}),
            )),
            "messages[2].tool_calls[0].id",
            "missing_required_parameter",
        );
    }

    #[test]
    fn content_part_errors() {
        let parts = |p: Value| chat(json!({"messages": [{"role": "user", "content": p}]}));
        rejects(
            chat_request(&parts(
                json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]),
            )),
            "messages[0].content[1].type",
            "unsupported_value",
        );
        let e = chat_request(&parts(json!([{"type": "image_url"}]))).unwrap_err();
        assert!(
            e.to_string().contains("Image content is not supported"),
            "{e}"
        );
        rejects(
            chat_request(&parts(json!([{"type": "input_audio"}]))),
            "messages[0].content[0].type",
            "invalid_value",
        );
        rejects(
            chat_request(&parts(json!([{"text": "a"}]))),
            "messages[0].content[0].type",
            "missing_required_parameter",
        );
        rejects(
            chat_request(&parts(json!([{"type": "text"}]))),
            "messages[0].content[0].text",
            "missing_required_parameter",
        );
        rejects(
            chat_request(&parts(json!([{"type": "text", "text": 1}]))),
            "messages[0].content[0].text",
            "invalid_type",
        );
        rejects(
            chat_request(&parts(json!(["a"]))),
            "messages[0].content[0]",
            "invalid_type",
        );
    }

    #[test]
    fn sampling_ranges() {
        let cases = [
            ("temperature", json!(2.5), "decimal_above_max_value"),
            ("temperature", json!(-0.1), "decimal_below_min_value"),
            ("temperature", json!("hot"), "invalid_type"),
            ("top_p", json!(0), "decimal_below_min_value"),
            ("top_p", json!(1.01), "decimal_above_max_value"),
            ("min_p", json!(-1), "decimal_below_min_value"),
            ("min_p", json!(2), "decimal_above_max_value"),
            ("presence_penalty", json!(2.1), "decimal_above_max_value"),
            ("frequency_penalty", json!(-3), "decimal_below_min_value"),
            ("repetition_penalty", json!(0), "decimal_below_min_value"),
            ("top_k", json!(-2), "integer_below_min_value"),
            ("top_k", json!(1.5), "invalid_type"),
            ("seed", json!("1"), "invalid_type"),
            ("max_tokens", json!(0), "integer_below_min_value"),
            ("max_tokens", json!("5"), "invalid_type"),
            (
                "max_completion_tokens",
                json!(-1),
                "integer_below_min_value",
            ),
            ("n", json!(9), "integer_above_max_value"),
            ("n", json!(0), "integer_below_min_value"),
            ("stream", json!("yes"), "invalid_type"),
            ("logprobs", json!(1), "invalid_type"),
            ("stop", json!(3), "invalid_type"),
            (
                "stop",
                json!(["a", "b", "c", "d", "e"]),
                "array_above_max_length",
            ),
            ("logit_bias", json!([1]), "invalid_type"),
            ("logit_bias", json!({"x": 1}), "invalid_value"),
            ("tools", json!({"type": "function"}), "invalid_type"),
            ("response_format", json!("json"), "invalid_type"),
        ];
        for (field, value, code) in cases {
            let mut extra = Map::new();
            extra.insert(field.to_owned(), value.clone());
            let r = chat_request(&chat(Value::Object(extra)));
            let e = r.expect_err(&format!("{field}={value} should fail"));
            assert_eq!(e.param(), Some(field), "{field}={value}: {e}");
            assert_eq!(e.code(), code, "{field}={value}: {e}");
            assert_eq!(e.status().as_u16(), 400);
        }
    }

    #[test]
    fn messages_name_the_value() {
        let e = chat_request(&chat(json!({"temperature": 3}))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 3 instead."
        );
        assert_eq!(chat_request(&chat(json!({"n": 3}))).unwrap().common.n, 3);
        assert_eq!(chat_request(&chat(json!({}))).unwrap().common.n, 1);
    }

    #[test]
    fn response_formats_become_grammars() {
        let format = |f: Value| chat_request(&chat(json!({"response_format": f})));
        let grammar = |f: Value| format(f).unwrap().common.grammar;
        assert_eq!(grammar(json!({"type": "text"})), None);
        assert_eq!(
            grammar(json!({"type": "json_object"})),
            Some(Grammar::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            grammar(json!({"type": "json_schema",
                "json_schema": {"name": "a_1", "schema": schema, "strict": true}})),
            Some(Grammar::JsonSchema(schema))
        );
        assert_eq!(
            grammar(json!({"type": "regex", "regex": "[0-9]+"})),
            Some(Grammar::Regex("[0-9]+".into()))
        );
        assert_eq!(
            grammar(json!({"type": "lark", "lark": "start: \"yes\" | \"no\""})),
            Some(Grammar::Lark("start: \"yes\" | \"no\"".into()))
        );
        let cases = [
            (
                json!({}),
                "response_format.type",
                "missing_required_parameter",
            ),
            (
                json!({"type": "xml"}),
                "response_format.type",
                "invalid_value",
            ),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
                "missing_required_parameter",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
                "missing_required_parameter",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
                "response_format.json_schema.name",
                "invalid_value",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}),
                "response_format.json_schema.schema",
                "invalid_type",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}),
                "response_format.json_schema.strict",
                "invalid_type",
            ),
            (
                json!({"type": "regex"}),
                "response_format.regex",
                "missing_required_parameter",
            ),
            (
                json!({"type": "lark", "lark": 1}),
                "response_format.lark",
                "invalid_type",
            ),
        ];
        for (f, param, code) in cases {
            rejects(format(f.clone()), param, code);
        }
    }

    #[test]
    fn nested_params() {
        rejects(
            chat_request(&chat(json!({"logit_bias": {"5": 101}}))),
            "logit_bias.5",
            "decimal_above_max_value",
        );
        rejects(
            chat_request(&chat(json!({"logit_bias": {"5": "x"}}))),
            "logit_bias.5",
            "invalid_type",
        );
        rejects(
            chat_request(&chat(json!({"stop": ["a", 1]}))),
            "stop[1]",
            "invalid_type",
        );
        rejects(
            chat_request(&chat(
                json!({"stream": true, "stream_options": {"include_usage": "y"}}),
            )),
            "stream_options.include_usage",
            "invalid_type",
        );
        rejects(
            chat_request(&chat(json!({"stream": true, "stream_options": 1}))),
            "stream_options",
            "invalid_type",
        );
        rejects(
            chat_request(&chat(json!({"stream_options": {"include_usage": true}}))),
            "stream_options",
            "invalid_value",
        );
    }

    #[test]
    fn logprob_rules() {
        rejects(
            chat_request(&chat(json!({"top_logprobs": 2}))),
            "top_logprobs",
            "invalid_value",
        );
        rejects(
            chat_request(&chat(json!({"logprobs": true, "top_logprobs": 21}))),
            "top_logprobs",
            "integer_above_max_value",
        );
        let r = chat_request(&chat(json!({"logprobs": true}))).unwrap();
        assert_eq!(r.common.logprobs, Some(0));
        let r = chat_request(&chat(json!({"logprobs": false}))).unwrap();
        assert_eq!(r.common.logprobs, None);

        let r = completion_request(&completion(json!({"logprobs": 5}))).unwrap();
        assert_eq!(r.common.logprobs, Some(5));
        rejects(
            completion_request(&completion(json!({"logprobs": 6}))),
            "logprobs",
            "integer_above_max_value",
        );
        rejects(
            completion_request(&completion(json!({"logprobs": true}))),
            "logprobs",
            "invalid_type",
        );
    }

    #[test]
    fn prompts() {
        let p = |v: Value| completion_request(&completion(json!({"prompt": v}))).map(|r| r.prompt);
        assert_eq!(p(json!("a")).unwrap(), Prompt::Text("a".into()));
        assert_eq!(p(json!(["a"])).unwrap(), Prompt::Text("a".into()));
        assert_eq!(p(json!([1, 2, 3])).unwrap(), Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(p(json!([[4, 5]])).unwrap(), Prompt::Tokens(vec![4, 5]));
        rejects(p(json!(["a", "b"])), "prompt", "unsupported_value");
        rejects(p(json!([[1], [2]])), "prompt", "unsupported_value");
        rejects(p(json!([])), "prompt", "empty_array");
        rejects(p(json!([1, -2])), "prompt[1]", "invalid_value");
        rejects(p(json!([1, "x"])), "prompt[1]", "invalid_type");
        rejects(p(json!([[1, 2.5]])), "prompt[0][1]", "invalid_value");
        rejects(p(json!(7)), "prompt", "invalid_type");
        rejects(
            completion_request(&json!({"model": "m"})),
            "prompt",
            "missing_required_parameter",
        );
    }

    #[test]
    fn completion_defaults_and_refusals() {
        let r = completion_request(&completion(json!({}))).unwrap();
        assert_eq!(r.common.max_tokens, Some(DEFAULT_COMPLETION_MAX_TOKENS));
        assert_eq!(r.common.logprobs, None);
        let r = completion_request(&completion(
            json!({"max_tokens": 3, "echo": false, "best_of": 1}),
        ))
        .unwrap();
        assert_eq!(r.common.max_tokens, Some(3));
        rejects(
            completion_request(&completion(json!({"echo": true}))),
            "echo",
            "unsupported_value",
        );
        rejects(
            completion_request(&completion(json!({"best_of": 2}))),
            "best_of",
            "unsupported_value",
        );
        rejects(
            completion_request(&completion(json!({"suffix": "x"}))),
            "suffix",
            "unsupported_value",
        );
        rejects(
            completion_request(&completion(json!({"n": 9}))),
            "n",
            "integer_above_max_value",
        );
    }
}
