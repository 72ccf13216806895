//! Request and response body types and the helpers handlers use to read JSON
//! and answer with JSON.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::connections::{BodyTimedOut, ReadDeadline};
use super::error::ApiError;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::BodyTooLarge { limit })
        }
        Err(e) => match e.downcast_ref::<BodyTimedOut>() {
            Some(t) => Err(ApiError::RequestTimeout { secs: t.secs }),
            None => Err(ApiError::BodyRead(e.to_string())),
        },
    }
}

/// Reads and parses a JSON body; malformed JSON is a 400 naming the problem.
pub async fn read_json<T: DeserializeOwned>(req: Request<ReqBody>) -> Result<T, ApiError> {
    let bytes = read_bytes(req).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))
}
