//! Helpers for the routing tests: a fake OpenAI-compatible upstream (hyper on
//! a loopback port, in its own runtime), API-key hashing, policy uploads.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// First event of a streamed answer; the rest waits for [`FakeUpstream::release`].
pub const FIRST_EVENT: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n";
pub const LAST_EVENT: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"last\"}}]}\n\n";

/// An upstream answering `POST /v1/chat/completions` and `/v1/completions`:
/// JSON echoing what it received (model, path, query, authorization,
/// request id, traceparent, the names of all request headers),
/// or, with `"stream": true`, an SSE stream whose first event is sent at
/// once and the rest only after [`FakeUpstream::release`]. Model
/// `echo-body` answers with the body it received as its text; model
/// `echo-stream`, streamed, with one event carrying it, then `[DONE]`. Model `slow`
/// answers after 10 s; model `status-429` answers 429 with an error body.
pub struct FakeUpstream {
    pub addr: SocketAddr,
    release: Arc<Notify>,
    _rt: tokio::runtime::Runtime,
}

impl FakeUpstream {
    pub fn start() -> FakeUpstream {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind upstream");
        let addr = listener.local_addr().expect("addr");
        let release = Arc::new(Notify::new());
        let r = release.clone();
        rt.spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let r = r.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| answer(req, r.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        FakeUpstream {
            addr,
            release,
            _rt: rt,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Lets one streamed answer finish.
    pub fn release(&self) {
        self.release.notify_one();
    }
}

fn full(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed_unsync());
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

async fn answer(
    req: Request<Incoming>,
    release: Arc<Notify>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    let mut names: Vec<String> = req
        .headers()
        .keys()
        .map(|k| k.as_str().to_owned())
        .collect();
    names.sort();
    names.dedup();
    let header = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (auth, request_id) = (header("authorization"), header("x-request-id"));
    let traceparent = header("traceparent");
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let model = v["model"].as_str().unwrap_or_default().to_owned();
    if model == "slow" {
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    if model == "status-429" {
        let e = json!({"error": {"message": "upstream says slow down", "type": "rate_limit_error", "param": null, "code": "rate_limited"}});
        return Ok(full(StatusCode::TOO_MANY_REQUESTS, &e));
    }
    if v["stream"] == json!(true) && model == "echo-stream" {
        // The body received, as the one event's text, then the end.
        let event = json!({"choices": [{"delta": {"content": v.to_string()}}]});
        let text = format!("data: {event}\n\ndata: [DONE]\n\n");
        let mut r = Response::new(Full::new(Bytes::from(text)).boxed_unsync());
        r.headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        return Ok(r);
    }
    if v["stream"] == json!(true) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
        tokio::spawn(async move {
            let _ = tx.send(Bytes::from_static(FIRST_EVENT.as_bytes())).await;
            release.notified().await;
            let _ = tx.send(Bytes::from_static(LAST_EVENT.as_bytes())).await;
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            let b = rx.recv().await?;
            Some((Ok::<_, Infallible>(Frame::data(b)), rx))
        });
        let mut r = Response::new(StreamBody::new(stream).boxed_unsync());
        r.headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        return Ok(r);
    }
    Ok(full(
        StatusCode::OK,
        &json!({
            "id": "chatcmpl-upstream",
            "object": "chat.completion",
            "model": model,
            "path": path,
            "query": query,
            "headers": names,
            "authorization": auth,
            "x_request_id": request_id,
            "traceparent": traceparent,
            "body": v,
            // Model `echo-body`: the body received, as the answer's text.
            "choices": [{"index": 0, "message": {"role": "assistant", "content":
                if model == "echo-body" { v.to_string() } else { "from upstream".to_owned() }},
                "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2},
        }),
    ))
}

/// Hex sha256, as `[[keys]] sha256` wants.
pub fn key_hash(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Percent-encoding of a query value: the CLI's own.
#[allow(unused_imports)]
pub use mlxgate::cli::remote::query_value as urlencode;
