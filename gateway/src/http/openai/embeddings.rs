//! `POST /v1/embeddings` in OpenAI's shape: routed like the other inference
//! endpoints (a router may send it to an upstream), then served by a local
//! model that embeds: an encoder, or a chat model with `embeddings = true`.

use base64::Engine as _;
use http::{Request, StatusCode};
use serde_json::{Value, json};

use super::validate::{Fields, invalid, missing, token_ids, unsupported, wrong_type};
use super::{HandlerResult, validate};
use crate::engine::embed::EmbedInput;
use crate::http::body::{self, ReqBody};
use crate::http::routing::{self, Routed};
use crate::http::{ApiError, Ctx};

/// OpenAI's bound on inputs per request.
const MAX_INPUTS: usize = 2048;

/// A checked `/v1/embeddings` body.
#[derive(Debug, PartialEq)]
pub struct EmbeddingRequest {
    pub model: String,
    pub inputs: Vec<EmbedInput>,
    pub base64: bool,
    pub dimensions: Option<usize>,
    /// mlxgate's extension: cut over-long inputs instead of refusing them.
    pub truncate: bool,
}

pub async fn create(cx: Ctx, req: Request<ReqBody>) -> HandlerResult {
    let local = match routing::dispatch(&cx, req, validate::Endpoint::Embeddings).await? {
        Routed::Local(local) => local,
        Routed::Proxied(resp) => return Ok(resp),
    };
    let request = embedding_request(&local.json)?;
    let embedder = cx.state.app.models.resolve_embedder(&request.model)?;
    let native = embedder.dimensions();
    if let Some(dimensions) = request.dimensions.filter(|&d| d != native) {
        return Err(unsupported(
            "dimensions",
            &format!(
                "The model `{}` makes {native}-dimensional vectors and cannot shorten them to {dimensions} (it was not trained for truncation); leave out 'dimensions' or send {native}.",
                request.model
            ),
        ));
    }
    let out = embedder
        .embed(request.inputs, request.truncate)
        .await
        .map_err(|e| ApiError::from_engine(e, "input"))?;
    let data: Vec<Value> = out
        .vectors
        .iter()
        .enumerate()
        .map(|(index, vector)| {
            let embedding = if request.base64 {
                json!(little_endian_base64(vector))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    local.meter.prompt(out.prompt_tokens as u64);
    let usage = json!({"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens});
    let mut answer =
        json!({"object": "list", "data": data, "model": request.model, "usage": usage});
    if request.truncate {
        answer["truncated_inputs"] = json!(out.truncated);
    }
    body::json(StatusCode::OK, &answer)
}

/// The vector as OpenAI's `encoding_format: "base64"` sends it: the f32
/// values' little-endian bytes, base64-encoded.
fn little_endian_base64(vector: &[f32]) -> String {
    let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn embedding_request(body: &Value) -> Result<EmbeddingRequest, ApiError> {
    let f = Fields::of(body)?;
    let model = f
        .string("model")?
        .ok_or_else(|| missing("model"))?
        .to_owned();
    let inputs = inputs(f.get("input").ok_or_else(|| missing("input"))?)?;
    let base64 = match f.string("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(invalid(
                "encoding_format",
                "invalid_value",
                &format!("Invalid 'encoding_format': '{other}'. Expected 'float' or 'base64'."),
            ));
        }
    };
    Ok(EmbeddingRequest {
        model,
        inputs,
        base64,
        dimensions: f.positive_int("dimensions")?,
        truncate: f.bool("truncate")?.unwrap_or(false),
    })
}

/// `input`: a string, an array of strings, an array of token ids, or an
/// array of arrays of token ids.
fn inputs(value: &Value) -> Result<Vec<EmbedInput>, ApiError> {
    let items = match value {
        Value::String(text) => return Ok(vec![EmbedInput::Text(text.clone())]),
        Value::Array(items) => items,
        other => return Err(wrong_type("input", "string or array", other)),
    };
    if items.is_empty() {
        return Err(invalid(
            "input",
            "empty_array",
            "Invalid 'input': empty array. Expected a string, an array of strings, an array of token ids or an array of token-id arrays.",
        ));
    }
    if items.len() > MAX_INPUTS {
        return Err(invalid(
            "input",
            "array_above_max_length",
            &format!(
                "Invalid 'input': {} inputs; at most {MAX_INPUTS} per request.",
                items.len()
            ),
        ));
    }
    if items.iter().all(Value::is_number) {
        return Ok(vec![EmbedInput::Tokens(token_ids("input", items)?)]);
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(text) => Ok(EmbedInput::Text(text.clone())),
            Value::Array(ids) => Ok(EmbedInput::Tokens(token_ids(&format!("input[{i}]"), ids)?)),
            other => Err(wrong_type(
                &format!("input[{i}]"),
                "string or array of token ids",
                other,
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(result: Result<EmbeddingRequest, ApiError>) -> (String, &'static str) {
        match result {
            Err(ApiError::InvalidParam { param, code, .. }) => (param, code),
            other => panic!("expected a 400 with a param, got {other:?}"),
        }
    }

    #[test]
    fn every_input_shape_reads_and_bad_ones_name_their_field() {
        let read = |input: Value| {
            embedding_request(&json!({"model": "m", "input": input})).map(|r| r.inputs)
        };
        assert_eq!(
            read(json!("hi")).unwrap(),
            vec![EmbedInput::Text("hi".into())]
        );
        assert_eq!(
            read(json!(["a", [5, 6]])).unwrap(),
            vec![EmbedInput::Text("a".into()), EmbedInput::Tokens(vec![5, 6])]
        );
        assert_eq!(
            read(json!([1, 2])).unwrap(),
            vec![EmbedInput::Tokens(vec![1, 2])]
        );
        let param =
            |input: Value| param_of(embedding_request(&json!({"model": "m", "input": input})));
        assert_eq!(param(json!([])), ("input".into(), "empty_array"));
        assert_eq!(param(json!(3)), ("input".into(), "invalid_type"));
        assert_eq!(param(json!(["a", 3])), ("input[1]".into(), "invalid_type"));
        assert_eq!(
            param(json!([[1, -1]])),
            ("input[0][1]".into(), "invalid_value")
        );
        assert_eq!(
            param(json!(vec!["x"; MAX_INPUTS + 1])),
            ("input".into(), "array_above_max_length")
        );
        let body = |extra: Value| {
            let mut b = json!({"model": "m", "input": "x"});
            b.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            embedding_request(&b)
        };
        assert_eq!(
            param_of(body(json!({"encoding_format": "hex"}))).0,
            "encoding_format"
        );
        assert_eq!(param_of(body(json!({"dimensions": 0}))).0, "dimensions");
        assert_eq!(param_of(body(json!({"truncate": "yes"}))).0, "truncate");
        assert_eq!(
            param_of(embedding_request(&json!({"model": "m"}))).0,
            "input"
        );
        assert!(body(json!({"encoding_format": "base64"})).unwrap().base64);
    }

    #[test]
    fn base64_is_the_little_endian_floats() {
        let encoded = little_endian_base64(&[1.0, -2.5]);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap();
        assert_eq!(
            bytes,
            [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat()
        );
    }
}
