//! Configured upstream OpenAI-compatible endpoints and the proxy that
//! forwards requests to them.
//!
//! Upstreams exist only in the config (`[[upstreams]]`): a router policy can
//! name one but never supply a URL, so a guest cannot make the gateway talk
//! to an arbitrary host. The proxy forwards the method, the path under `/v1`,
//! the body (with `model` rewritten when the decision names one) and a few
//! selected headers, authenticates with the upstream's own key (never the
//! client's), and streams the answer back frame by frame, so server-sent
//! events reach the client as the upstream writes them.
//!
//! Each upstream keeps an in-flight count and its last error, which the
//! router sees as the upstream's backend state.

use std::fmt;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{
    ACCEPT, AUTHORIZATION, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HeaderMap, HeaderName,
    HeaderValue, USER_AGENT,
};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::Deserialize;

use super::body::{Body, BoxError};

/// Default for `timeout_secs`: connect plus first byte of the answer. A
/// non-streamed completion sends its first byte only when it is done.
pub const DEFAULT_TIMEOUT_SECS: f64 = 60.0;

/// After a failure an upstream reports unhealthy for this long (or until a
/// request succeeds), so routers that avoid unhealthy backends retry it later.
const UNHEALTHY_FOR: Duration = Duration::from_secs(10);

/// One `[[upstreams]]` entry.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSpec {
    /// What router policies call it.
    pub name: String,
    /// `http://host:port/v1`: a request for `/v1/chat/completions` goes to
    /// `{base_url}/chat/completions`.
    pub base_url: String,
    /// Environment variable holding the upstream's API key (preferred).
    pub api_key_env: Option<String>,
    /// The API key itself, for keys that are not secret (local servers).
    pub api_key: Option<String>,
    /// Connect plus first byte, in seconds (fractions allowed).
    pub timeout_secs: Option<f64>,
    /// Models sent here when no router policy decides (none bound, or a
    /// `fail_open` one failed): a static route table. A bound router
    /// overrides it.
    #[serde(default)]
    pub models: Vec<String>,
}

impl fmt::Debug for UpstreamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamSpec")
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .field("api_key_env", &self.api_key_env)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("timeout_secs", &self.timeout_secs)
            .field("models", &self.models)
            .finish()
    }
}

/// Checks `[[upstreams]]`: unique plain names, `http://` base URLs, at most
/// one key source and its environment variable set, a sane timeout.
pub fn validate_specs(specs: &[UpstreamSpec]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    let mut models = std::collections::HashSet::new();
    for s in specs {
        let ok_name = (1..=64).contains(&s.name.len())
            && s.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !ok_name {
            return Err(format!(
                "invalid upstream name `{}`: use 1-64 characters from [A-Za-z0-9_.-]",
                s.name
            ));
        }
        if !seen.insert(s.name.as_str()) {
            return Err(format!("upstream name `{}` is used twice", s.name));
        }
        if let Some(m) = s.models.iter().find(|m| !models.insert(m.as_str())) {
            return Err(format!("model `{m}` is listed by two upstreams"));
        }
        Base::parse(&s.base_url).map_err(|e| format!("upstream `{}`: {e}", s.name))?;
        if s.api_key.is_some() && s.api_key_env.is_some() {
            return Err(format!(
                "upstream `{}`: set api_key or api_key_env, not both",
                s.name
            ));
        }
        if let Some(var) = &s.api_key_env
            && std::env::var_os(var).is_none_or(|v| v.is_empty())
        {
            return Err(format!(
                "upstream `{}`: environment variable {var} (api_key_env) is not set",
                s.name
            ));
        }
        let t = s.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS);
        if !(t.is_finite() && t > 0.0 && t <= 3600.0) {
            return Err(format!(
                "upstream `{}`: timeout_secs must be in (0, 3600], not {t}",
                s.name
            ));
        }
    }
    Ok(())
}

/// Scheme, authority and path prefix of a base URL.
#[derive(Debug, Clone)]
struct Base {
    authority: http::uri::Authority,
    /// Without a trailing `/`; may be empty.
    prefix: String,
}

impl Base {
    fn parse(url: &str) -> Result<Base, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("invalid base_url `{url}`: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "base_url `{url}`: https is not supported (no TLS client is built in); put a local TLS proxy in front"
                ));
            }
            _ => return Err(format!("base_url `{url}` must start with http://")),
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("base_url `{url}` has no host"))?;
        if uri.query().is_some() {
            return Err(format!("base_url `{url}` must not have a query"));
        }
        Ok(Base {
            authority,
            prefix: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// The upstream URI for a gateway path under `/v1` (query kept).
    fn uri_for(&self, path_and_query: &str) -> Result<Uri, String> {
        let rest = path_and_query.strip_prefix("/v1").unwrap_or(path_and_query);
        Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(format!("{}{rest}", self.prefix))
            .build()
            .map_err(|e| format!("cannot build the upstream URL: {e}"))
    }
}

/// Why a proxied request failed before the upstream's answer began.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error(
        "the routing policy chose upstream `{0}`, which is not configured (see [[upstreams]] in the config)"
    )]
    Unknown(String),
    #[error("upstream `{name}` is unavailable: {detail}")]
    Unavailable { name: String, detail: String },
    #[error("upstream `{name}` did not answer within {secs} s")]
    Timeout { name: String, secs: f64 },
    #[error("cannot forward the request to upstream `{name}`: {detail}")]
    Request { name: String, detail: String },
}

impl UpstreamError {
    pub fn status(&self) -> StatusCode {
        match self {
            UpstreamError::Unknown(_) | UpstreamError::Unavailable { .. } => {
                StatusCode::BAD_GATEWAY
            }
            UpstreamError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            UpstreamError::Request { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            UpstreamError::Unknown(_) => "unknown_upstream",
            UpstreamError::Unavailable { .. } => "upstream_unavailable",
            UpstreamError::Timeout { .. } => "upstream_timeout",
            UpstreamError::Request { .. } => "upstream_request_failed",
        }
    }
}

/// What the router (and `GET /admin/upstreams`) sees of an upstream.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UpstreamStatus {
    pub name: String,
    pub healthy: bool,
    pub in_flight: u32,
    pub last_error: Option<String>,
}

#[derive(Default)]
struct Health {
    last_error: Option<(String, Instant)>,
    last_ok: Option<Instant>,
}

/// One configured upstream with its connection pool and live counters.
pub struct Upstream {
    pub name: String,
    /// Models routed here statically (see [`UpstreamSpec::models`]).
    models: Vec<String>,
    base: Base,
    /// `Bearer <key>`, marked sensitive so it never shows in debug output.
    auth: Option<HeaderValue>,
    timeout: Duration,
    client: Client<HttpConnector, Full<Bytes>>,
    in_flight: AtomicU32,
    health: Mutex<Health>,
}

impl Upstream {
    /// Builds the upstream; the spec must have passed [`validate_specs`]
    /// (an invalid one is reported as unavailable on each request).
    fn new(spec: &UpstreamSpec) -> Upstream {
        let key = spec.api_key.clone().or_else(|| {
            spec.api_key_env
                .as_ref()
                .and_then(|v| std::env::var(v).ok())
        });
        let auth = key.and_then(|k| {
            let mut v = HeaderValue::from_str(&format!("Bearer {k}")).ok()?;
            v.set_sensitive(true);
            Some(v)
        });
        let mut connector = HttpConnector::new();
        // Small request/response exchanges: don't wait for Nagle.
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        let base = Base::parse(&spec.base_url).unwrap_or_else(|_| Base {
            // Unreachable when validated; the port-0 authority fails fast.
            authority: http::uri::Authority::from_static("invalid.invalid:0"),
            prefix: String::new(),
        });
        Upstream {
            name: spec.name.clone(),
            models: spec.models.clone(),
            base,
            auth,
            timeout: Duration::from_secs_f64(spec.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS)),
            client,
            in_flight: AtomicU32::new(0),
            health: Mutex::new(Health::default()),
        }
    }

    pub fn status(&self) -> UpstreamStatus {
        let h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        let healthy = match &h.last_error {
            None => true,
            Some((_, at)) => h.last_ok.is_some_and(|ok| ok > *at) || at.elapsed() > UNHEALTHY_FOR,
        };
        UpstreamStatus {
            name: self.name.clone(),
            healthy,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            last_error: h.last_error.as_ref().map(|(e, _)| e.clone()),
        }
    }

    fn record_ok(&self) {
        self.health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_ok = Some(Instant::now());
    }

    fn record_error(&self, what: String) {
        self.health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_error = Some((what, Instant::now()));
    }
}

/// Decrements the in-flight count when the proxied exchange is over (the
/// response body finished or was dropped).
struct InFlight(Arc<Upstream>);

impl InFlight {
    fn start(u: &Arc<Upstream>) -> InFlight {
        u.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(u))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The configured upstreams, in config order.
pub struct Upstreams {
    list: Vec<Arc<Upstream>>,
}

impl Upstreams {
    pub fn new(specs: &[UpstreamSpec]) -> Upstreams {
        Upstreams {
            list: specs.iter().map(|s| Arc::new(Upstream::new(s))).collect(),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Upstream>> {
        self.list.iter().find(|u| u.name == name)
    }

    /// The upstream that statically serves `model`, if any.
    pub fn for_model(&self, model: &str) -> Option<&Arc<Upstream>> {
        self.list
            .iter()
            .find(|u| u.models.iter().any(|m| m == model))
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn statuses(&self) -> Vec<UpstreamStatus> {
        self.list.iter().map(|u| u.status()).collect()
    }
}

/// Request headers forwarded as they are; everything else (the client's
/// `authorization` above all) stays here.
const FORWARDED: [HeaderName; 3] = [ACCEPT, USER_AGENT, HeaderName::from_static("openai-beta")];

/// Response headers not passed back: hop-by-hop ones, and the length, which
/// hyper recomputes from the streamed body.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    name == CONNECTION
        || name == CONTENT_LENGTH
        || name == http::header::TRANSFER_ENCODING
        || name == http::header::TE
        || name == http::header::TRAILER
        || name == http::header::UPGRADE
        || name == http::header::PROXY_AUTHENTICATE
        || name.as_str() == "keep-alive"
}

/// What to send upstream.
pub struct Outgoing<'a> {
    pub method: Method,
    /// The gateway path and query, e.g. `/v1/chat/completions`.
    pub path_and_query: &'a str,
    /// The client's request headers (a few are forwarded).
    pub headers: &'a HeaderMap,
    /// The JSON body, already rewritten.
    pub body: Bytes,
    pub request_id: &'a str,
}

/// Forwards `out` to `upstream` and returns its answer, streamed. Fails only
/// before the answer starts: unreachable (502), no headers within the
/// timeout (504). The upstream's own error statuses and bodies pass through.
pub async fn proxy(
    upstream: &Arc<Upstream>,
    out: Outgoing<'_>,
) -> Result<Response<Body>, UpstreamError> {
    let name = &upstream.name;
    let uri = upstream
        .base
        .uri_for(out.path_and_query)
        .map_err(|detail| UpstreamError::Request {
            name: name.clone(),
            detail,
        })?;
    let mut req = Request::new(Full::new(out.body));
    *req.method_mut() = out.method;
    *req.uri_mut() = uri;
    let h = req.headers_mut();
    for n in &FORWARDED {
        if let Some(v) = out.headers.get(n) {
            h.insert(n.clone(), v.clone());
        }
    }
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Ok(v) = HeaderValue::from_str(out.request_id) {
        h.insert(HeaderName::from_static("x-request-id"), v);
    }
    if let Some(a) = &upstream.auth {
        h.insert(AUTHORIZATION, a.clone());
    }

    let guard = InFlight::start(upstream);
    let resp = match tokio::time::timeout(upstream.timeout, upstream.client.request(req)).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => {
            let detail = if e.is_connect() {
                format!("cannot connect: {}", error_chain(&e))
            } else {
                error_chain(&e)
            };
            upstream.record_error(detail.clone());
            tracing::warn!(upstream = %name, error = %detail, "upstream request failed");
            return Err(UpstreamError::Unavailable {
                name: name.clone(),
                detail,
            });
        }
        Err(_) => {
            let secs = upstream.timeout.as_secs_f64();
            upstream.record_error(format!("no answer within {secs} s"));
            tracing::warn!(upstream = %name, secs, "upstream timed out");
            return Err(UpstreamError::Timeout {
                name: name.clone(),
                secs,
            });
        }
    };

    if resp.status().is_server_error() {
        upstream.record_error(format!("answered {}", resp.status()));
    } else {
        upstream.record_ok();
    }
    let (parts, incoming) = resp.into_parts();
    let failed = Arc::clone(upstream);
    let body = incoming
        .map_err(move |e| -> BoxError {
            failed.record_error(format!("response body: {e}"));
            Box::new(e)
        })
        // The guard lives as long as the body: in flight until streamed out.
        .map_frame(move |f| {
            let _ = &guard;
            f
        })
        .boxed_unsync();
    let mut out_resp = Response::new(body);
    *out_resp.status_mut() = parts.status;
    let headers = out_resp.headers_mut();
    for (k, v) in &parts.headers {
        if !is_hop_by_hop(k) {
            headers.append(k.clone(), v.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(name) {
        headers.insert(HeaderName::from_static("x-mlxgate-upstream"), v);
    }
    Ok(out_resp)
}

/// An error and its sources, `: `-joined (hyper's own messages are terse).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, url: &str) -> UpstreamSpec {
        UpstreamSpec {
            name: name.into(),
            base_url: url.into(),
            api_key_env: None,
            api_key: None,
            timeout_secs: None,
            models: vec![],
        }
    }

    #[test]
    fn base_urls_map_paths_under_v1() {
        let b = Base::parse("http://127.0.0.1:9000/v1/").unwrap();
        assert_eq!(
            b.uri_for("/v1/chat/completions").unwrap().to_string(),
            "http://127.0.0.1:9000/v1/chat/completions"
        );
        let b = Base::parse("http://h:1").unwrap();
        assert_eq!(
            b.uri_for("/v1/completions?x=1").unwrap().to_string(),
            "http://h:1/completions?x=1"
        );
        assert!(Base::parse("https://api.openai.com/v1").is_err());
        assert!(Base::parse("ftp://x/v1").is_err());
        assert!(Base::parse("not a url").is_err());
    }

    #[test]
    fn specs_are_validated() {
        assert!(validate_specs(&[spec("a", "http://x/v1"), spec("b", "http://y/v1")]).is_ok());
        assert!(validate_specs(&[spec("a", "http://x/v1"), spec("a", "http://y/v1")]).is_err());
        assert!(validate_specs(&[spec("a b", "http://x/v1")]).is_err());
        let (mut a, mut b) = (spec("a", "http://x/v1"), spec("b", "http://y/v1"));
        a.models = vec!["m".into()];
        b.models = vec!["m".into()];
        assert!(
            validate_specs(&[a, b])
                .unwrap_err()
                .contains("two upstreams")
        );
        let mut s = spec("a", "http://x/v1");
        s.api_key = Some("k".into());
        s.api_key_env = Some("MLXGATE_TEST_NO_SUCH_VAR".into());
        assert!(validate_specs(&[s.clone()]).is_err());
        s.api_key = None;
        assert!(validate_specs(&[s]).unwrap_err().contains("not set"));
        let mut s = spec("a", "http://x/v1");
        s.timeout_secs = Some(0.0);
        assert!(validate_specs(&[s]).is_err());
    }

    #[test]
    fn parsed_from_the_config_file() {
        let f: crate::config::FileConfig = toml::from_str(
            "[[upstreams]]\nname = \"openai\"\nbase_url = \"http://127.0.0.1:9000/v1\"\n\
             api_key = \"k\"\ntimeout_secs = 2.5\nmodels = [\"gpt-4o\"]\n",
        )
        .unwrap();
        assert_eq!(f.upstreams[0].timeout_secs, Some(2.5));
        assert_eq!(
            Upstreams::new(&f.upstreams)
                .for_model("gpt-4o")
                .unwrap()
                .name,
            "openai"
        );
        assert!(
            toml::from_str::<crate::config::FileConfig>(
                "[[upstreams]]\nname = \"a\"\nbase_url = \"http://x\"\nurl = \"y\""
            )
            .is_err()
        );
    }

    #[test]
    fn debug_redacts_the_key() {
        let mut s = spec("a", "http://x/v1");
        s.api_key = Some("sk-secret".into());
        assert!(!format!("{s:?}").contains("sk-secret"));
    }
}
