//! The proxy: one [`Upstream`] per `[[upstreams]]` entry (its pool, health
//! and in-flight count), and [`proxy`], which forwards a request and streams
//! the answer back.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{
    ACCEPT, AUTHORIZATION, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HOST, HeaderMap, HeaderName,
    HeaderValue, USER_AGENT,
};
use http::{Method, Request, Response, Uri};
use hyper::body::{Body as _, Frame, SizeHint};

use super::breaker::{Breaker, BreakerSettings, Skip, retry_after};
use super::pool::{Dialer, Lease, Pool, Reply};
use super::{
    Base, DEFAULT_BREAKER_COOLDOWN_SECS, DEFAULT_BREAKER_FAILURES, DEFAULT_TIMEOUT_SECS,
    HealthCheckSpec, PROXIED_PATHS, Protocol, UpstreamSpec, normalize_path,
};
use crate::util::BoxError;

/// Why a proxied request failed before the upstream's answer began.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error(
        "the routing policy chose upstream `{0}`, which is not configured (see [[upstreams]] in the config)"
    )]
    Unknown(String),
    /// `reason` is a fixed phrase: the cause, which may name the upstream's
    /// address, is only logged.
    #[error(
        "upstream `{name}` is unavailable ({reason}); the gateway log has the details (look for this request's x-request-id)"
    )]
    Unavailable { name: String, reason: &'static str },
    #[error("upstream `{name}` did not answer within {secs} s")]
    Timeout { name: String, secs: f64 },
    /// The request path cannot be forwarded as it is (see [`normalize_path`]).
    #[error(
        "the request path cannot be forwarded to upstream `{name}`: {why}; send the request to one of /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/messages or /v1/responses"
    )]
    InvalidPath { name: String, why: &'static str },
    #[error(
        "cannot forward the request to upstream `{name}`; the gateway log has the details (look for this request's x-request-id)"
    )]
    Request { name: String },
    /// The router chose an upstream that does not speak the client's API.
    #[error(
        "upstream `{name}` does not speak the {protocol} API of this request (its `protocols` in [[upstreams]] do not list \"{protocol}\"); route it to an upstream that does (only Anthropic Messages requests are translated, to OpenAI chat)"
    )]
    Protocol {
        name: String,
        protocol: &'static str,
    },
    /// Passed over without being asked: circuit open, Retry-After,
    /// `max_in_flight` (503, with `Retry-After` when known).
    #[error("upstream `{name}` is not taking requests now: {reason}")]
    Skipped {
        name: String,
        reason: &'static str,
        retry_after: Option<Duration>,
    },
}

impl UpstreamError {
    /// Whether the next upstream in a fallback order may answer instead:
    /// this one failed or was passed over before its answer began.
    pub fn falls_back(&self) -> bool {
        matches!(
            self,
            UpstreamError::Unavailable { .. }
                | UpstreamError::Timeout { .. }
                | UpstreamError::Skipped { .. }
                | UpstreamError::Protocol { .. }
        )
    }
}

/// What the router (and `GET /admin/upstreams`) sees of an upstream.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct UpstreamStatus {
    pub name: String,
    pub healthy: bool,
    pub in_flight: u32,
    pub last_error: Option<String>,
    /// `closed`, `open` or `half_open`.
    pub circuit: &'static str,
    /// Moving average of the time to the answer's head.
    pub latency_ms: Option<f64>,
}

/// One configured upstream with its connection pool and live counters.
pub struct Upstream {
    pub name: String,
    /// Models routed here statically (see [`UpstreamSpec::models`]).
    models: Vec<String>,
    base: Base,
    /// Where and how connections are made.
    dialer: Dialer,
    /// The `host` header sent.
    host: HeaderValue,
    /// Upstream targets of [`PROXIED_PATHS`], in that order.
    targets: Vec<Option<Uri>>,
    /// `x-mlxgate-upstream` on answers.
    name_header: Option<HeaderValue>,
    /// `Bearer <key>`, marked sensitive so it never shows in debug output.
    auth: Option<HeaderValue>,
    /// The key alone (sensitive), for Anthropic's `x-api-key`.
    key: Option<HeaderValue>,
    protocols: Vec<Protocol>,
    /// Tried next when this one fails or is passed over.
    fallbacks: Vec<String>,
    /// See [`UpstreamSpec::stream_usage`].
    stream_usage: bool,
    health_check: Option<HealthCheckSpec>,
    timeout: Duration,
    pool: Arc<Pool>,
    in_flight: AtomicU32,
    breaker: Mutex<Breaker>,
    /// Whether the breaker may turn a request away (circuit not closed, a
    /// Retry-After pending, a `max_in_flight` cap): when not, admission
    /// takes no lock and reads no clock. Set under the breaker's lock.
    guarded: AtomicBool,
}

impl Upstream {
    /// Whether streamed OpenAI requests to it may ask for usage
    /// (`[[upstreams]] stream_usage`).
    pub fn stream_usage(&self) -> bool {
        self.stream_usage
    }

    /// Whether it speaks `protocol` (`[[upstreams]] protocols`).
    pub fn speaks(&self, protocol: Protocol) -> bool {
        self.protocols.contains(&protocol)
    }

    /// Builds the upstream; the spec must have passed [`validate_specs`]
    /// (an invalid one is reported as unavailable on each request).
    fn new(spec: &UpstreamSpec) -> Upstream {
        let key = spec.api_key.clone().or_else(|| {
            spec.api_key_env
                .as_ref()
                .and_then(|v| std::env::var(v).ok())
        });
        let sensitive = |text: String| {
            let mut v = HeaderValue::from_str(&text).ok()?;
            v.set_sensitive(true);
            Some(v)
        };
        let auth = key.as_ref().and_then(|k| sensitive(format!("Bearer {k}")));
        let key = key.and_then(sensitive);
        let timeout = Duration::from_secs_f64(spec.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS));
        let base = Base::parse(&spec.base_url).unwrap_or_else(|_| Base {
            // Unreachable when validated; the port-0 authority fails fast.
            tls: false,
            authority: http::uri::Authority::from_static("invalid.invalid:0"),
            prefix: String::new(),
        });
        Upstream {
            name: spec.name.clone(),
            models: spec.models.clone(),
            dialer: dialer(spec, &base),
            host: HeaderValue::from_str(base.authority.as_str())
                .unwrap_or_else(|_| HeaderValue::from_static("invalid.invalid")),
            targets: PROXIED_PATHS
                .iter()
                .map(|p| base.target_for(p).ok())
                .collect(),
            name_header: HeaderValue::from_str(&spec.name).ok(),
            base,
            auth,
            key,
            protocols: spec.protocols.clone(),
            fallbacks: spec.fallbacks.clone(),
            stream_usage: spec.stream_usage.unwrap_or(true),
            health_check: spec.health_check.clone(),
            timeout,
            pool: Arc::new(Pool::default()),
            in_flight: AtomicU32::new(0),
            breaker: Mutex::new(Breaker::new(BreakerSettings {
                failures: spec.breaker_failures.unwrap_or(DEFAULT_BREAKER_FAILURES),
                cooldown: Duration::from_secs_f64(
                    spec.breaker_cooldown_secs
                        .unwrap_or(DEFAULT_BREAKER_COOLDOWN_SECS),
                ),
                max_in_flight: spec.max_in_flight,
                probe_timeout: timeout,
            })),
            guarded: AtomicBool::new(spec.max_in_flight.is_some()),
        }
    }

    /// Whether it takes a request now (see `breaker.rs`).
    fn admit(&self) -> Result<(), UpstreamError> {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        self.breaker().admit(Instant::now(), in_flight).map_err(
            |Skip {
                 reason,
                 retry_after,
             }| UpstreamError::Skipped {
                name: self.name.clone(),
                reason,
                retry_after,
            },
        )
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the breaker, then notes whether it may turn requests
    /// away ([`Upstream::guarded`]).
    fn with_breaker<T>(&self, f: impl FnOnce(&mut Breaker) -> T) -> T {
        let mut b = self.breaker();
        let out = f(&mut b);
        self.guarded.store(b.guards(), Ordering::Relaxed);
        out
    }

    /// The upstream target for a gateway path and query: the query is
    /// dropped, the path normalized ([`normalize_path`]).
    fn target_for(&self, path_and_query: &str) -> Result<Uri, TargetError> {
        let path = path_and_query
            .split_once('?')
            .map_or(path_and_query, |(p, _)| p);
        if let Some(t) = self.cached_target(path) {
            return Ok(t);
        }
        let path = normalize_path(path).map_err(TargetError::Path)?;
        if let Some(t) = self.cached_target(&path) {
            return Ok(t);
        }
        if path != "/v1" && !path.starts_with("/v1/") {
            return Err(TargetError::Path("it is not under /v1"));
        }
        self.base.target_for(&path).map_err(TargetError::Build)
    }

    fn cached_target(&self, path: &str) -> Option<Uri> {
        let i = PROXIED_PATHS.iter().position(|p| *p == path)?;
        self.targets.get(i)?.clone()
    }

    /// Idle pooled connections (tests and diagnostics).
    /// The upstream URI for a gateway path, or why it cannot be forwarded.
    fn target(&self, path_and_query: &str) -> Result<Uri, UpstreamError> {
        self.target_for(path_and_query).map_err(|e| match e {
            TargetError::Path(why) => UpstreamError::InvalidPath {
                name: self.name.clone(),
                why,
            },
            TargetError::Build(detail) => {
                tracing::error!(upstream = %self.name, error = %detail, "cannot build the upstream request");
                UpstreamError::Request {
                    name: self.name.clone(),
                }
            }
        })
    }

    /// [`exchange`] bounded by the upstream's timeout; records the outcome
    /// in the upstream's health (an answer of 5xx counts as a failure).
    async fn exchange_within_timeout(
        &self,
        request: impl Fn() -> Request<Bytes>,
    ) -> Result<(Response<Reply>, Lease), UpstreamError> {
        let name = &self.name;
        let started = Instant::now();
        let answer = match tokio::time::timeout(self.timeout, exchange(self, request)).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(Failure { reason, detail })) => {
                tracing::warn!(upstream = %name, error = %detail, "upstream request failed");
                self.record_error(detail);
                return Err(UpstreamError::Unavailable {
                    name: name.clone(),
                    reason,
                });
            }
            Err(_) => {
                let secs = self.timeout.as_secs_f64();
                self.record_error(format!("no answer within {secs} s"));
                tracing::warn!(upstream = %name, secs, "upstream timed out");
                return Err(UpstreamError::Timeout {
                    name: name.clone(),
                    secs,
                });
            }
        };
        let status = answer.0.status();
        let wait = answer
            .0
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(retry_after);
        let now = Instant::now();
        self.with_breaker(|breaker| {
            if let Some(wait) = wait.filter(|_| status == 429 || status == 503) {
                breaker.wait(now, wait);
            }
            if status.is_server_error() {
                breaker.failed(now, format!("answered {status}"));
            } else {
                breaker.succeeded(now, Some(now - started));
            }
        });
        Ok(answer)
    }

    /// The answer's head as the client gets it: hop-by-hop headers stay
    /// here (the length is recomputed by hyper from the body's exact size
    /// hint), and `x-mlxgate-upstream` names the upstream.
    fn pass_back(&self, parts: &mut http::response::Parts) {
        for h in HOP_BY_HOP {
            parts.headers.remove(h);
        }
        if let Some(v) = &self.name_header {
            parts.headers.insert(UPSTREAM_HEADER.clone(), v.clone());
        }
    }

    pub fn idle_connections(&self) -> usize {
        self.pool.idle_count()
    }

    pub fn status(&self) -> UpstreamStatus {
        let b = self.breaker();
        UpstreamStatus {
            name: self.name.clone(),
            healthy: b.healthy(Instant::now()),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            last_error: b.last_error(),
            circuit: b.circuit_name(),
            latency_ms: b.latency_ms(),
        }
    }

    fn record_error(&self, what: String) {
        self.with_breaker(|b| b.failed(Instant::now(), what));
    }

    /// The active health check, once: `GET {base_url}{path}` within its
    /// timeout; 2xx closes the circuit, anything else counts as a failure.
    async fn check_health(&self, check: &HealthCheckSpec) {
        let Ok(target) = self.target(&format!("/v1{}", check.path)) else {
            return;
        };
        let request = || {
            let mut req = Request::new(Bytes::new());
            *req.uri_mut() = target.clone();
            let h = req.headers_mut();
            h.insert(HOST, self.host.clone());
            if let Some(a) = &self.auth {
                h.insert(AUTHORIZATION, a.clone());
            }
            if let Some(k) = &self.key {
                h.insert(X_API_KEY.clone(), k.clone());
            }
            req
        };
        let timeout = Duration::from_secs_f64(check.timeout_secs);
        let started = Instant::now();
        let outcome = match tokio::time::timeout(timeout, exchange(self, request)).await {
            Ok(Ok((resp, lease))) => {
                let status = resp.status();
                // Read the (small) answer so the connection can be pooled.
                let mut body = ProxyBody {
                    reply: resp.into_body(),
                    lease: Some(lease),
                    guard: None,
                    pool: Arc::clone(&self.pool),
                };
                while let Some(Ok(_)) = http_body_util::BodyExt::frame(&mut body).await {}
                if status.is_success() {
                    Ok(())
                } else {
                    Err(format!("health check answered {status}"))
                }
            }
            Ok(Err(Failure { detail, .. })) => Err(format!("health check: {detail}")),
            Err(_) => Err(format!(
                "health check: no answer within {} s",
                check.timeout_secs
            )),
        };
        match outcome {
            Ok(()) => self
                .breaker()
                .succeeded(Instant::now(), Some(started.elapsed())),
            Err(e) => {
                tracing::warn!(upstream = %self.name, error = %e, "upstream health check failed");
                self.record_error(e);
            }
        }
    }
}

/// How to reach `base`: over TLS for `https://`, verifying the certificate
/// against the host name. A TLS setup that fails here (its files changed
/// since the config was checked) leaves an upstream every request reports
/// unavailable, with the cause logged.
fn dialer(spec: &UpstreamSpec, base: &Base) -> Dialer {
    let authority = base.socket_authority();
    let scheme = if base.tls { "https" } else { "http" };
    let origin = Uri::try_from(format!("{scheme}://{}", base.authority))
        .unwrap_or_else(|_| Uri::from_static("https://invalid.invalid"));
    if !base.tls {
        return Dialer {
            authority,
            tls: None,
            origin,
        };
    }
    let host = base
        .authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let tls = crate::util::tls::client_config(&spec.client_tls()).and_then(|config| {
        let name = rustls::pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| format!("`{host}` is not a host name TLS can verify: {e}"))?;
        Ok((tokio_rustls::TlsConnector::from(config), name))
    });
    match tls {
        Ok(tls) => Dialer {
            authority,
            tls: Some(tls),
            origin,
        },
        Err(e) => {
            tracing::error!(upstream = %spec.name, error = %e, "cannot set up TLS; the upstream is unavailable");
            Dialer {
                authority: "invalid.invalid:0".into(),
                tls: None,
                origin,
            }
        }
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

    /// `(model, upstream)` for each model an upstream declares in its
    /// `models`, in config order.
    pub fn declared_models(&self) -> impl Iterator<Item = (&str, &str)> {
        self.list
            .iter()
            .flat_map(|u| u.models.iter().map(|m| (m.as_str(), u.name.as_str())))
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn statuses(&self) -> Vec<UpstreamStatus> {
        self.list.iter().map(|u| u.status()).collect()
    }

    /// The upstreams a request for `names` tries, in order: those named
    /// (a router's decision may name several), and when it names one, that
    /// one's configured `fallbacks` after it. Each at most once.
    pub fn in_order(&self, names: &[&str]) -> Result<Vec<Arc<Upstream>>, UpstreamError> {
        let mut order: Vec<Arc<Upstream>> = Vec::with_capacity(names.len() + 2);
        for name in names {
            let u = self
                .get(name)
                .ok_or_else(|| UpstreamError::Unknown((*name).to_owned()))?;
            if !order.iter().any(|o| Arc::ptr_eq(o, u)) {
                order.push(Arc::clone(u));
            }
        }
        if let [only] = names
            && let Some(first) = self.get(only)
        {
            for f in &first.fallbacks {
                if let Some(u) = self.get(f)
                    && !order.iter().any(|o| Arc::ptr_eq(o, u))
                {
                    order.push(Arc::clone(u));
                }
            }
        }
        Ok(order)
    }

    /// Starts each configured upstream's active health check, on the
    /// current runtime, for as long as it runs.
    pub fn start_health_checks(&self) {
        for u in &self.list {
            let Some(check) = u.health_check.clone() else {
                continue;
            };
            let u = Arc::clone(u);
            tokio::spawn(async move {
                let every = Duration::from_secs_f64(check.interval_secs);
                let mut ticks = tokio::time::interval(every);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    u.check_health(&check).await;
                }
            });
        }
    }
}

/// Why no upstream target could be built for a request.
enum TargetError {
    /// The client's path (see [`normalize_path`]).
    Path(&'static str),
    /// Anything else; logged, not shown.
    Build(String),
}

/// The client request headers forwarded as they are (an allow-list). All
/// others stay here: the client's `authorization` (the upstream gets its
/// own key), cookies, `x-forwarded-*`, `openai-organization`/`-project`
/// (they would name the client's account on the gateway's key), and the
/// client's `x-request-id`: the gateway sends its own id, which is the
/// client's only when it passed the gateway's check (`http::request_id`).
/// `content-type` is always `application/json` and `host` the upstream's.
const FORWARDED: [HeaderName; 3] = [ACCEPT, USER_AGENT, HeaderName::from_static("openai-beta")];

/// Anthropic's key header, and the version and beta headers its clients
/// send (passed on to Anthropic-protocol upstreams; `anthropic-version`
/// defaults to 2023-06-01).
static X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
static ANTHROPIC_VERSION: HeaderName = HeaderName::from_static("anthropic-version");
static ANTHROPIC_BETA: HeaderName = HeaderName::from_static("anthropic-beta");

/// Response headers not passed back: hop-by-hop ones, and the length, which hyper recomputes from the streamed body.
const HOP_BY_HOP: [HeaderName; 8] = [
    CONNECTION,
    CONTENT_LENGTH,
    http::header::TRANSFER_ENCODING,
    http::header::TE,
    http::header::TRAILER,
    http::header::UPGRADE,
    http::header::PROXY_AUTHENTICATE,
    HeaderName::from_static("keep-alive"),
];

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Names the upstream that answered, on every proxied answer.
pub static UPSTREAM_HEADER: HeaderName = HeaderName::from_static("x-mlxgate-upstream");

/// What to send upstream.
#[derive(Clone)]
pub struct Outgoing<'a> {
    pub method: Method,
    /// The gateway path, e.g. `/v1/chat/completions`; a query is ignored
    /// and the path normalized, so the client's raw request target can be
    /// passed.
    pub path_and_query: &'a str,
    /// The client's request headers (only [`FORWARDED`] ones are sent).
    pub headers: &'a HeaderMap,
    /// The JSON body, already rewritten.
    pub body: Bytes,
    /// The gateway's own request id (never a client header unchecked).
    pub request_id: &'a str,
    /// The API of the request; the upstream must speak it.
    pub protocol: Protocol,
    /// W3C trace context of the call, sent as `traceparent` (traces on).
    pub traceparent: Option<&'a str>,
}

/// Forwards `out` to `upstream` and returns its answer, streamed. Fails only
/// before the answer starts: unreachable (502), no headers within the
/// timeout (504). The upstream's own error statuses and bodies pass through.
pub async fn proxy(
    upstream: &Arc<Upstream>,
    out: Outgoing<'_>,
) -> Result<Response<ProxyBody>, UpstreamError> {
    if !upstream.protocols.contains(&out.protocol) {
        return Err(UpstreamError::Protocol {
            name: upstream.name.clone(),
            protocol: out.protocol.as_str(),
        });
    }
    let target = upstream.target(out.path_and_query)?;
    upstream.admit()?;
    let request_id = HeaderValue::from_str(out.request_id).ok();
    let traceparent = out.traceparent.and_then(|t| HeaderValue::from_str(t).ok());
    let request = || {
        let mut req = Request::new(out.body.clone());
        *req.method_mut() = out.method.clone();
        *req.uri_mut() = target.clone();
        let h = req.headers_mut();
        h.reserve(8);
        h.insert(HOST, upstream.host.clone());
        for n in &FORWARDED {
            if let Some(v) = out.headers.get(n) {
                h.insert(n.clone(), v.clone());
            }
        }
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(v) = &request_id {
            h.insert(X_REQUEST_ID.clone(), v.clone());
        }
        if let Some(v) = &traceparent {
            h.insert(TRACEPARENT.clone(), v.clone());
        }
        match out.protocol {
            Protocol::Openai => {
                if let Some(a) = &upstream.auth {
                    h.insert(AUTHORIZATION, a.clone());
                }
            }
            Protocol::Anthropic => {
                if let Some(k) = &upstream.key {
                    h.insert(X_API_KEY.clone(), k.clone());
                }
                let version = out.headers.get(&ANTHROPIC_VERSION).cloned();
                h.insert(
                    ANTHROPIC_VERSION.clone(),
                    version.unwrap_or(HeaderValue::from_static("2023-06-01")),
                );
                if let Some(beta) = out.headers.get(&ANTHROPIC_BETA) {
                    h.insert(ANTHROPIC_BETA.clone(), beta.clone());
                }
            }
        }
        req
    };

    let guard = InFlight::start(upstream);
    let (resp, lease) = upstream.exchange_within_timeout(request).await?;
    let (mut parts, reply) = resp.into_parts();
    upstream.pass_back(&mut parts);
    let mut body = ProxyBody {
        reply,
        lease: Some(lease),
        guard: Some(guard),
        pool: Arc::clone(&upstream.pool),
    };
    if body.is_end_stream() {
        // No body: the server will not poll it, so the connection is done now.
        body.finish();
    }
    Ok(Response::from_parts(parts, body))
}

/// Why an exchange failed: a fixed phrase for the client, the cause (which
/// may name the upstream's address) for the log.
struct Failure {
    reason: &'static str,
    detail: String,
}

impl Failure {
    fn exchange(e: &BoxError) -> Failure {
        Failure {
            reason: "the connection failed before an answer",
            detail: error_chain(&**e),
        }
    }
}

/// Sends the request on a pooled connection (or a new one) and waits for the
/// answer's head. A reused connection that fails before any answer (the
/// upstream closed it as we sent) is replaced by a new one, once.
async fn exchange(
    upstream: &Upstream,
    request: impl Fn() -> Request<Bytes>,
) -> Result<(Response<Reply>, Lease), Failure> {
    let mut lease = match upstream.pool.checkout() {
        Some(l) => l,
        None => connect(upstream).await?,
    };
    match lease.send(request()).await {
        Ok(resp) => return Ok((resp, lease)),
        Err(e) if lease.reused => {
            tracing::debug!(upstream = %upstream.name, error = %error_chain(&*e), "pooled connection failed; retrying on a new one");
        }
        Err(e) => return Err(Failure::exchange(&e)),
    }
    let mut lease = connect(upstream).await?;
    match lease.send(request()).await {
        Ok(resp) => Ok((resp, lease)),
        Err(e) => Err(Failure::exchange(&e)),
    }
}

async fn connect(upstream: &Upstream) -> Result<Lease, Failure> {
    upstream
        .pool
        .connect(&upstream.dialer)
        .await
        .map_err(|e| Failure {
            reason: e.reason,
            detail: e.detail,
        })
}

/// The upstream's answer body, passed through frame by frame. Polling it
/// reads the upstream connection, which returns to the pool once the body
/// is complete; dropping it early closes the connection.
pub struct ProxyBody {
    reply: Reply,
    lease: Option<Lease>,
    /// In flight until the body is streamed out or dropped (a client's
    /// request; health checks are not counted).
    guard: Option<InFlight>,
    /// Where the connection goes back when the body is complete.
    pool: Arc<Pool>,
}

impl ProxyBody {
    fn finish(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.pool.checkin(lease);
        }
    }

    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BoxError>>> {
        match &mut self.reply {
            Reply::H2(incoming) => loop {
                match std::task::ready!(Pin::new(&mut *incoming).poll_frame(cx)) {
                    // Trailers are not passed on.
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => return Poll::Ready(Some(Ok(data))),
                        Err(_) => continue,
                    },
                    Some(Err(e)) => return Poll::Ready(Some(Err(Box::new(e)))),
                    None => return Poll::Ready(None),
                }
            },
            Reply::H1 => match self.lease.as_mut().and_then(Lease::h1) {
                Some(conn) => conn.poll_data(cx).map_err(BoxError::from),
                None => Poll::Ready(None),
            },
        }
    }
}

impl hyper::body::Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match std::task::ready!(this.poll_data(cx)) {
            Some(Ok(data)) => {
                if this.is_end_stream() {
                    this.finish();
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            None => {
                this.finish();
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                this.lease = None;
                if let Some(guard) = &this.guard {
                    guard.0.record_error(format!("response body: {e}"));
                }
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.reply {
            Reply::H2(incoming) => incoming.is_end_stream(),
            Reply::H1 => self.lease.as_ref().is_none_or(Lease::is_done),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.reply {
            Reply::H2(incoming) => incoming.size_hint(),
            Reply::H1 => match self.lease.as_ref().map_or(Some(0), Lease::remaining) {
                Some(n) => SizeHint::with_exact(n),
                None => SizeHint::default(),
            },
        }
    }
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
    use http::StatusCode;
    use http_body_util::BodyExt;

    fn spec(name: &str, url: &str) -> UpstreamSpec {
        UpstreamSpec::new(name, url)
    }

    #[test]
    fn the_query_is_dropped_and_the_path_normalized() {
        let up = Upstream::new(&spec("a", "http://h:1/base/v1/"));
        let target = |p: &str| up.target_for(p).ok().map(|u| u.to_string());
        for p in [
            "/v1/chat/completions",
            "/v1/chat/completions?x=1",
            "//v1/chat/completions",
            "//v1//chat/completions?api-version=1&x=y",
        ] {
            assert_eq!(
                target(p).as_deref(),
                Some("/base/v1/chat/completions"),
                "{p}"
            );
        }
        assert_eq!(
            target("/v1/embeddings?x=1").as_deref(),
            Some("/base/v1/embeddings")
        );
        assert!(matches!(
            up.target_for("/v1/../admin"),
            Err(TargetError::Path(_))
        ));
        assert!(matches!(
            up.target_for("/admin/x"),
            Err(TargetError::Path(_))
        ));
    }

    #[test]
    fn errors_name_the_upstream_but_no_address() {
        let e = UpstreamError::Unavailable {
            name: "up".into(),
            reason: "cannot connect",
        };
        assert!(e.to_string().contains("`up`"), "{e}");
        assert!(!e.to_string().contains("127.0.0.1"), "{e}");
    }

    #[test]
    fn parsed_from_the_config_file() {
        /// The `[[upstreams]]` part of the config file.
        #[derive(serde::Deserialize)]
        struct FileConfig {
            upstreams: Vec<UpstreamSpec>,
        }
        let f: FileConfig = toml::from_str(
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
            toml::from_str::<FileConfig>(
                "[[upstreams]]\nname = \"a\"\nbase_url = \"http://x\"\nurl = \"y\""
            )
            .is_err()
        );
    }

    // ---------------------------------------------------------------- pool

    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::AtomicUsize;

    /// What the raw test upstream does with one accepted connection
    /// (numbered from 0): answer requests, close, ...
    type Script = fn(usize, TcpStream);

    /// A raw HTTP/1.1 upstream on loopback running `script` per connection;
    /// returns its base URL and the number of connections accepted so far.
    fn raw_upstream(script: Script) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                let n = count.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || script(n, s));
            }
        });
        (format!("http://{addr}/v1"), accepted)
    }

    /// Reads one request (head and `content-length` body); false at EOF.
    fn read_request(s: &mut TcpStream) -> bool {
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            match s.read(&mut byte) {
                Ok(1) => buf.push(byte[0]),
                _ => return false,
            }
        }
        let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
        let len = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        let mut body = vec![0; len];
        s.read_exact(&mut body).is_ok()
    }

    fn answer(s: &mut TcpStream, close: bool) {
        let body = r#"{"ok":true}"#;
        let connection = if close { "connection: close\r\n" } else { "" };
        let _ = write!(
            s,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{connection}content-length: {}\r\n\r\n{body}",
            body.len()
        );
    }

    /// Answers every request on the connection, keeping it open.
    fn keep_alive(_: usize, mut s: TcpStream) {
        while read_request(&mut s) {
            answer(&mut s, false);
        }
    }

    /// An OpenAI POST of `{"model":"m"}` to `path`, with no client headers.
    fn post<'a>(path: &'a str, headers: &'a HeaderMap) -> Outgoing<'a> {
        Outgoing {
            method: Method::POST,
            path_and_query: path,
            headers,
            body: Bytes::from_static(br#"{"model":"m"}"#),
            request_id: "req-1",
            protocol: Protocol::Openai,
            traceparent: None,
        }
    }

    async fn call(up: &Arc<Upstream>) -> Result<(StatusCode, Bytes), UpstreamError> {
        let headers = HeaderMap::new();
        let resp = proxy(up, post("/v1/chat/completions", &headers)).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Ok((status, body))
    }

    fn upstream(url: &str) -> Arc<Upstream> {
        let mut s = spec("up", url);
        s.timeout_secs = Some(5.0);
        Arc::new(Upstream::new(&s))
    }

    #[tokio::test]
    async fn hop_by_hop_headers_stay_here_and_the_others_pass() {
        let (url, _) = raw_upstream(|_, mut s| {
            while read_request(&mut s) {
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\nconnection: keep-alive\r\nkeep-alive: timeout=5\r\n\
                      x-custom: 1\r\ncontent-length: 2\r\n\r\nok",
                );
            }
        });
        let up = upstream(&url);
        let headers = HeaderMap::new();
        let resp = proxy(&up, post("/v1/chat/completions", &headers))
            .await
            .unwrap();
        let h = resp.headers();
        assert!(
            h.get(CONNECTION).is_none() && h.get("keep-alive").is_none(),
            "{h:?}"
        );
        assert!(
            h.get(CONTENT_LENGTH).is_none(),
            "hyper writes the length: {h:?}"
        );
        assert_eq!(h.get("x-custom").unwrap(), "1");
        assert_eq!(h.get("x-mlxgate-upstream").unwrap(), "up");
    }

    #[tokio::test]
    async fn keep_alive_connections_are_reused() {
        let (url, accepted) = raw_upstream(keep_alive);
        let up = upstream(&url);
        for _ in 0..5 {
            let (status, body) = call(&up).await.unwrap();
            assert_eq!(
                (status, &body[..]),
                (StatusCode::OK, &br#"{"ok":true}"#[..])
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(up.idle_connections(), 1);
        assert_eq!(up.status().in_flight, 0);
    }

    #[test]
    fn each_serving_thread_reuses_only_the_connections_it_opened() {
        let (url, accepted) = raw_upstream(keep_alive);
        let up = upstream(&url);
        // Each thread as a serving thread: its own runtime (and reactor).
        let serve = |index: usize, calls: usize| {
            let up = Arc::clone(&up);
            std::thread::spawn(move || {
                crate::util::threads::set_serving_index(index);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                for _ in 0..calls {
                    assert_eq!(rt.block_on(call(&up)).unwrap().0, StatusCode::OK);
                }
            })
            .join()
            .unwrap();
        };
        serve(0, 3);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // Thread 0's idle connection is not thread 1's to take.
        serve(1, 2);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(up.idle_connections(), 2);
    }

    #[tokio::test]
    async fn the_connection_is_pooled_as_soon_as_the_last_frame_is_read() {
        // hyper's server stops polling a body once `is_end_stream` says so.
        let (url, accepted) = raw_upstream(keep_alive);
        let up = upstream(&url);
        let headers = HeaderMap::new();
        for _ in 0..3 {
            let out = post("/v1/chat/completions", &headers);
            let mut body = proxy(&up, out).await.unwrap().into_body();
            let mut got = Vec::new();
            while !body.is_end_stream() {
                got.extend_from_slice(&body.frame().await.unwrap().unwrap().into_data().unwrap());
            }
            assert_eq!(got, br#"{"ok":true}"#);
            assert_eq!(up.idle_connections(), 1);
            drop(body);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closes_after_answering_is_not_reused() {
        // `connection: close` on every answer.
        let (url, accepted) = raw_upstream(|_, mut s| {
            if read_request(&mut s) {
                answer(&mut s, true);
            }
        });
        let up = upstream(&url);
        for _ in 0..3 {
            assert_eq!(call(&up).await.unwrap().0, StatusCode::OK);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert_eq!(up.idle_connections(), 0);
    }

    #[tokio::test]
    async fn an_idle_connection_the_upstream_closed_is_replaced() {
        // Answers keep-alive, then closes the idle connection (an upstream's
        // idle timeout).
        let (url, accepted) = raw_upstream(|_, mut s| {
            if read_request(&mut s) {
                answer(&mut s, false);
            }
        });
        let up = upstream(&url);
        assert_eq!(call(&up).await.unwrap().0, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(call(&up).await.unwrap().0, StatusCode::OK);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_pooled_connection_closed_as_the_request_is_sent_is_retried_once() {
        // The first connection answers once, then takes the next request
        // and closes without answering; later connections answer.
        let (url, accepted) = raw_upstream(|n, mut s| {
            if n == 0 {
                if read_request(&mut s) {
                    answer(&mut s, false);
                }
                read_request(&mut s);
                return;
            }
            keep_alive(n, s);
        });
        let up = upstream(&url);
        assert_eq!(call(&up).await.unwrap().0, StatusCode::OK);
        assert_eq!(call(&up).await.unwrap().0, StatusCode::OK);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(up.idle_connections(), 1);
    }

    #[tokio::test]
    async fn a_new_connection_closed_without_an_answer_is_a_502_not_a_retry() {
        let (url, accepted) = raw_upstream(|_, mut s| {
            read_request(&mut s);
        });
        let up = upstream(&url);
        let e = call(&up).await.unwrap_err();
        assert!(matches!(e, UpstreamError::Unavailable { .. }), "{e}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert!(!up.status().healthy);
        assert_eq!(up.status().in_flight, 0);
    }

    #[tokio::test]
    async fn nothing_listening_is_a_502_naming_the_connect_failure() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let up = upstream(&format!("http://127.0.0.1:{port}/v1"));
        let e = call(&up).await.unwrap_err();
        assert!(matches!(e, UpstreamError::Unavailable { .. }), "{e}");
        assert!(e.to_string().contains("cannot connect"), "{e}");
        // The address stays in the log and the admin's status.
        assert!(!e.to_string().contains(&port.to_string()), "{e}");
        let last = up.status().last_error.unwrap();
        assert!(last.contains(&format!("127.0.0.1:{port}")), "{last}");
    }

    #[tokio::test]
    async fn a_body_dropped_midway_closes_its_connection() {
        // Announces 100 bytes, sends 10, then waits for the next request
        // on the same connection (which never comes).
        let (url, accepted) = raw_upstream(|_, mut s| {
            while read_request(&mut s) {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789");
            }
        });
        let up = upstream(&url);
        let headers = HeaderMap::new();
        let out = || post("/v1/completions", &headers);
        let mut body = proxy(&up, out()).await.unwrap().into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"0123456789");
        assert_eq!(up.status().in_flight, 1);
        drop(body);
        assert_eq!((up.idle_connections(), up.status().in_flight), (0, 0));
        let _ = proxy(&up, out()).await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    // ---------------------------------------------------------------- TLS

    /// An HTTPS upstream speaking only HTTP/2 (ALPN `h2`), answering each
    /// request with its HTTP version; returns its base URL, the CA that
    /// signed its certificate and the number of connections accepted.
    async fn h2_upstream(dir: &std::path::Path) -> (String, std::path::PathBuf, Arc<AtomicUsize>) {
        let (ca, cert, key) = crate::util::tls::test_pki(dir);
        let mut config = (*crate::util::tls::server_config(&cert, &key).unwrap()).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let tls = acceptor.accept(tcp).await.unwrap();
                    let service = hyper::service::service_fn(
                        |req: Request<hyper::body::Incoming>| async move {
                            let answer = format!("{:?} {}", req.version(), req.uri().path());
                            Ok::<_, std::convert::Infallible>(Response::new(
                                http_body_util::Full::new(Bytes::from(answer)),
                            ))
                        },
                    );
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
                });
            }
        });
        (format!("https://localhost:{port}/v1"), ca, accepted)
    }

    #[tokio::test]
    async fn an_https_upstream_that_offers_http2_gets_one_shared_http2_connection() {
        let dir = tempfile::tempdir().unwrap();
        let (url, ca, accepted) = h2_upstream(dir.path()).await;
        let mut s = spec("h2", &url);
        s.ca_file = Some(ca);
        let up = Arc::new(Upstream::new(&s));
        for _ in 0..3 {
            let (status, body) = call(&up).await.unwrap();
            assert_eq!(
                (status, &body[..]),
                (StatusCode::OK, &b"HTTP/2.0 /v1/chat/completions"[..])
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(up.status().in_flight, 0);
    }

    #[tokio::test]
    async fn an_untrusted_certificate_is_a_502_naming_tls() {
        let dir = tempfile::tempdir().unwrap();
        let (url, _, _) = h2_upstream(dir.path()).await;
        let other = tempfile::tempdir().unwrap();
        let (wrong_ca, _, _) = crate::util::tls::test_pki(other.path());
        let mut s = spec("h2", &url);
        s.ca_file = Some(wrong_ca);
        let up = Arc::new(Upstream::new(&s));
        let e = call(&up).await.unwrap_err();
        assert!(e.to_string().contains("TLS handshake failed"), "{e}");
        let last = up.status().last_error.unwrap();
        assert!(last.contains("invalid peer certificate"), "{last}");
    }
}
