//! Request and response body types and the helpers handlers use to read JSON
//! and answer with JSON.

use std::borrow::Cow;
use std::collections::HashMap;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;

use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::connections::{BodyTimedOut, ReadDeadline};
use super::error::ApiError;

pub use crate::util::BoxError;

/// Response body: boxed so a route can answer with a buffer or a stream
/// (server-sent events) through the same type.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Request body as handlers see it: already capped at the route's byte limit,
/// so reading it can never buffer more than that, and failing once the
/// request's read deadline passes (`[server] request_timeout_secs`).
pub type ReqBody = Limited<ReadDeadline<Incoming>>;

/// The byte limit applied to this request's body; in the request extensions.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub u64);

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    full(Bytes::new())
}

/// A JSON response with the given status.
pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Result<Response<Body>, ApiError> {
    let bytes = serde_json::to_vec(value)
        .map_err(|e| ApiError::Internal(format!("could not encode the response: {e}")))?;
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(resp)
}

/// Reads the whole body, mapping an over-limit body to 413 as soon as the
/// limit is crossed.
pub async fn read_bytes(req: Request<ReqBody>) -> Result<Bytes, ApiError> {
    let limit = req.extensions().get::<BodyLimit>().map_or(0, |l| l.0);
    read_body(req.into_body(), limit).await
}

/// [`read_bytes`] for a body already split from its request head; `limit`
/// is the request's [`BodyLimit`] (for the 413 message).
pub async fn read_body(body: ReqBody, limit: u64) -> Result<Bytes, ApiError> {
    match body.collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(body_error(&e, limit)),
    }
}

/// What a failed body read answers: 413 past the route's `limit`, 408 past
/// the body deadline, else 400.
pub fn body_error(e: &BoxError, limit: u64) -> ApiError {
    if e.downcast_ref::<LengthLimitError>().is_some() {
        return ApiError::BodyTooLarge { limit };
    }
    match e.downcast_ref::<BodyTimedOut>() {
        Some(t) => ApiError::RequestTimeout { secs: t.secs },
        None => ApiError::BodyRead(e.to_string()),
    }
}

/// Reads and parses a JSON body ([`parse_json`]), then reads it as `T`;
/// malformed JSON is a 400 naming the problem.
pub async fn read_json<T: DeserializeOwned>(req: Request<ReqBody>) -> Result<T, ApiError> {
    let bytes = read_bytes(req).await?;
    let value = parse_json(&bytes)?;
    serde_json::from_value(value).map_err(|e| ApiError::InvalidJson(e.to_string()))
}

/// Parses a request body as JSON, refusing an object that repeats a key (at
/// any depth). Parsers disagree on repeated keys (first wins, last wins, or
/// an error), so a body with one could be read one way by the router policy
/// or an upstream and another way here; refusing it leaves one reading.
pub fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = UniqueKeys
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v))
        .map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    Ok(value)
}

/// The top-level fields [`pick_json_fields`] kept of a body: their values
/// in the order the names were asked for (`None` where absent), or the whole
/// body when it is not an object (for validation's error).
#[derive(Debug, Clone, PartialEq)]
pub enum Picked<const N: usize> {
    Object([Option<Value>; N]),
    NotObject(Value),
}

/// [`parse_json`] for routing: the whole body is checked as JSON (repeated
/// keys refused where they are kept), but only the top-level `names` are
/// kept, into fixed slots, and the rest is skipped without building it. A
/// proxied body is forwarded as received, so nothing else of it is ever read
/// here: building its whole tree cost ~5,000 instructions per proxied
/// request, and a map of the kept fields another ~1,000 (a key string and a
/// node each).
pub fn pick_json_fields<const N: usize>(
    bytes: &[u8],
    names: &[&str; N],
) -> Result<Picked<N>, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let picked = TopLevel { names }
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v))
        .map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    match picked {
        Some(values) => Ok(Picked::Object(values)),
        None => parse_json(bytes).map(Picked::NotObject),
    }
}

/// Keeps the top-level `names` of an object; `None` for any other value.
struct TopLevel<'f, const N: usize> {
    names: &'f [&'f str; N],
}

impl<'de, const N: usize> DeserializeSeed<'de> for TopLevel<'_, N> {
    type Value = Option<[Option<Value>; N]>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, const N: usize> Visitor<'de> for TopLevel<'_, N> {
    type Value = Option<[Option<Value>; N]>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kept: [Option<Value>; N] = std::array::from_fn(|_| None);
        while let Some(Key(key)) = map.next_key::<Key>()? {
            let Some(slot) = self.names.iter().position(|n| *n == key.as_ref()) else {
                map.next_value::<de::IgnoredAny>()?;
                continue;
            };
            if kept[slot].is_some() {
                return Err(de::Error::custom(repeated_key(&key)));
            }
            kept[slot] = Some(map.next_value_seed(UniqueKeys)?);
        }
        Ok(Some(kept))
    }
}

/// An object key, borrowed from the body unless it has escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object key")
            }

            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(s)))
            }

            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

/// The error for a key an object repeats.
fn repeated_key(key: &str) -> String {
    let shown: String = key.chars().take(64).collect();
    format!("the key \"{shown}\" appears twice in one object; send each key once")
}

/// Builds a [`Value`] as `serde_json` does, but fails on a repeated key.
struct UniqueKeys;

impl<'de> DeserializeSeed<'de> for UniqueKeys {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for UniqueKeys {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::from(n))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::from(n))
    }

    fn visit_f64<E>(self, x: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element_seed(UniqueKeys)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(repeated_key(&key)));
            }
            let value = map.next_value_seed(UniqueKeys)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// Decodes `application/x-www-form-urlencoded` text (`+` is a space).
fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("bad percent escape at byte {i}"))?;
                out.push(hex);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| "not UTF-8 after decoding".to_string())
}

/// The query string's `key=value` pairs, percent-decoded; a bad escape
/// is a 400 naming its key.
pub fn query_params(req: &Request<ReqBody>) -> Result<HashMap<String, String>, ApiError> {
    let mut map = HashMap::new();
    for pair in req.uri().query().unwrap_or("").split('&') {
        if pair.is_empty() {
            continue;
        }
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = percent_decode(k).map_err(|e| bad_query(k, e))?;
        let v = percent_decode(v).map_err(|e| bad_query(&k, e))?;
        map.insert(k, v);
    }
    Ok(map)
}

fn bad_query(param: &str, message: String) -> ApiError {
    ApiError::InvalidRequest {
        message,
        param: Some(param.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%20b+c").unwrap(), "a b c");
        assert_eq!(percent_decode("%7B%22k%22%3A1%7D").unwrap(), "{\"k\":1}");
        assert!(percent_decode("%zz").is_err());
        assert!(percent_decode("%4").is_err());
        assert!(percent_decode("%ff").is_err());
    }

    #[test]
    fn repeated_keys_are_refused_at_any_depth() {
        for body in [
            r#"{"model": "a", "model": "b"}"#,
            r#"{"messages": [{"role": "user", "role": "system", "content": "x"}]}"#,
        ] {
            let e = parse_json(body.as_bytes()).unwrap_err();
            assert!(e.to_string().contains("appears twice"), "{e}");
        }
    }

    #[test]
    fn parses_as_serde_json_does() {
        let body =
            r#"{"a": [1, -2, 3.5, 1e3, "s", null, true, {"b": {}}], "c": 18446744073709551615}"#;
        let ours = parse_json(body.as_bytes()).unwrap();
        let theirs: Value = serde_json::from_str(body).unwrap();
        assert_eq!(ours, theirs);
        let kept = pick_json_fields(body.as_bytes(), &["x", "c"]).unwrap();
        assert_eq!(
            kept,
            Picked::Object([None, Some(serde_json::json!(18446744073709551615u64))])
        );
        assert_eq!(
            pick_json_fields(b"[1]", &["c"]).unwrap(),
            Picked::NotObject(serde_json::json!([1]))
        );
        assert!(pick_json_fields(br#"{"c": 1, "c": 2}"#, &["c"]).is_err());
        assert!(pick_json_fields(br#"{"c": null, "c": 2}"#, &["c"]).is_err());
        assert!(pick_json_fields(br#"{"a": [1, "#, &["c"]).is_err());
        assert!(parse_json(b"{} x").is_err(), "trailing characters");
        assert!(parse_json(b"{\"a\": 1").is_err());
    }
}
