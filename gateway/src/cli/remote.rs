//! The one client every command that talks to a running gateway uses
//! (`policy`, `jobs`, `cache`, `adapters`): where the gateway is, which key
//! to send, and the gateway's errors turned into messages.
//!
//! Which key: `MLXGATE_API_KEY`, or `MLXGATE_ADMIN_KEY` when that is unset;
//! for the operator API (`/admin/...`, the `policy` commands) the other way
//! round: `MLXGATE_ADMIN_KEY` first. One admin key therefore works for every
//! command, and a narrower `MLXGATE_API_KEY` set beside it is used for
//! everything but `/admin/`.

use anyhow::{Context, anyhow};
use bytes::Bytes;
use clap::Args;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Where the gateway is.
#[derive(Args, Debug, Clone)]
pub struct Remote {
    /// Base URL of the running gateway. The key sent is MLXGATE_API_KEY
    /// (MLXGATE_ADMIN_KEY if unset; for /admin/ calls MLXGATE_ADMIN_KEY first).
    #[arg(long, env = "MLXGATE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
}

/// A request body and its content type.
pub enum Payload {
    None,
    Json(Value),
    Wasm(Vec<u8>),
}

/// The key for a call to `path` (see the module docs for the rule).
pub fn api_key(path: &str) -> Option<String> {
    let var = |name: &str| std::env::var(name).ok().filter(|k| !k.is_empty());
    pick_key(path, var("MLXGATE_API_KEY"), var("MLXGATE_ADMIN_KEY"))
}

fn pick_key(path: &str, api: Option<String>, admin: Option<String>) -> Option<String> {
    if path.starts_with("/admin/") {
        admin.or(api)
    } else {
        api.or(admin)
    }
}

/// An open connection to the gateway, with what requests on it need.
pub struct Connection {
    pub sender: SendRequest<Full<Bytes>>,
    authority: String,
    /// The path prefix of `--url` (empty, or `/prefix`).
    base: String,
}

impl Remote {
    pub async fn connect(&self) -> anyhow::Result<Connection> {
        let url = &self.url;
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| anyhow!("--url must start with http:// (got {url})"))?
            .trim_end_matches('/');
        let (authority, base) = match rest.split_once('/') {
            Some((a, b)) => (a.to_owned(), format!("/{b}")),
            None => (rest.to_owned(), String::new()),
        };
        let stream = tokio::net::TcpStream::connect(&authority)
            .await
            .with_context(|| format!("cannot connect to {url}; is the gateway running?"))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(Connection {
            sender,
            authority,
            base,
        })
    }
}

impl Connection {
    /// A request for `path` under `--url`, with the key and the body.
    pub fn request(
        &self,
        method: Method,
        path: &str,
        payload: Payload,
    ) -> anyhow::Result<Request<Full<Bytes>>> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(HOST, &self.authority);
        if let Some(key) = api_key(path) {
            req = req.header(AUTHORIZATION, format!("Bearer {key}"));
        }
        let bytes = match payload {
            Payload::None => Bytes::new(),
            Payload::Json(v) => {
                req = req.header(CONTENT_TYPE, "application/json");
                Bytes::from(v.to_string())
            }
            Payload::Wasm(b) => {
                req = req.header(CONTENT_TYPE, "application/wasm");
                Bytes::from(b)
            }
        };
        Ok(req.body(Full::new(bytes))?)
    }
}

/// The gateway's error answer as a message: its `error.message` and `code`.
pub fn api_failure(status: StatusCode, bytes: &[u8]) -> anyhow::Error {
    let v: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
    let msg = v["error"]["message"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned());
    let code = v["error"]["code"].as_str().unwrap_or("");
    anyhow!("gateway answered {status}: {msg} [{code}]")
}

/// One call; a non-2xx answer becomes an error with the gateway's message.
pub async fn call(
    r: &Remote,
    method: Method,
    path: &str,
    payload: Payload,
) -> anyhow::Result<Value> {
    let mut conn = r.connect().await?;
    let req = conn.request(method, path, payload)?;
    let resp = conn.sender.send_request(req).await?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        return Err(api_failure(status, &bytes));
    }
    serde_json::from_slice(&bytes).context("the gateway's answer is not JSON")
}

/// [`call`] from synchronous code.
pub fn call_blocking(
    r: &Remote,
    method: Method,
    path: &str,
    payload: Payload,
) -> anyhow::Result<Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(call(r, method, path, payload))
}

/// [`call_blocking`], printing the answer as pretty JSON: what the
/// one-request commands (`cache`, `adapters`) do.
pub fn call_and_print(
    r: &Remote,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<()> {
    let payload = body.map_or(Payload::None, Payload::Json);
    print(&call_blocking(r, method, path, payload)?);
    Ok(())
}

/// Pretty JSON on stdout.
pub fn print(v: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

/// Percent-encodes a query value (RFC 3986 unreserved characters pass).
pub fn query_value(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_calls_prefer_the_admin_key() {
        let key = |path, api: Option<&str>, admin: Option<&str>| {
            pick_key(path, api.map(str::to_owned), admin.map(str::to_owned))
        };
        assert_eq!(
            key("/api/jobs", Some("app"), Some("root")).as_deref(),
            Some("app")
        );
        assert_eq!(
            key("/admin/policies", Some("app"), Some("root")).as_deref(),
            Some("root")
        );
        assert_eq!(
            key("/v1/prompt_caches", None, Some("root")).as_deref(),
            Some("root")
        );
        assert_eq!(
            key("/admin/policies", Some("app"), None).as_deref(),
            Some("app")
        );
        assert_eq!(key("/api/jobs", None, None), None);
    }
}
