//! The HTTP layer: routes, auth, errors in the OpenAI shape, metrics.
//!
//! Plain hyper 1 with a small route table instead of axum: the gateway needs
//! a handful of routes, one auth rule per URL zone and one error shape, which
//! a 30-line matcher covers; skipping axum/tower keeps the build lighter on
//! small machines and leaves every step of a request visible in `handle` and `route` below.
//!
//! # Adding routes
//! Add a line to [`routes`] (or have your module expose a `fn routes() ->
//! Vec<Route>` and `extend` it there):
//!
//! ```ignore
//! Route::new(Method::POST, "/admin/policies/{name}", |cx, req| Box::pin(policy::http::put(cx, req))),
//! ```
//!
//! with a handler `async fn put(cx: Ctx, req: Request<ReqBody>) -> Result<Response<Body>, ApiError>`.
//! `{name}` segments are read with `cx.param("name")`; the caller is in
//! `req.extensions().get::<Caller>()`; read JSON with `body::read_json(req)`.
//! Auth is decided by URL zone before routing (`/v1/` needs `infer`, `/api/`
//! `jobs`, `/admin/` `admin`; see [`auth::Zone`]), body size is capped, panics
//! become 500s, and metrics and logs are recorded, all without the handler
//! doing anything.

pub mod adapters;
pub mod admin_policies;
pub mod anthropic;
pub mod auth;
pub mod body;
pub mod connections;
pub mod console;
pub mod counting;
pub mod datasets;
pub mod error;
pub mod files;
mod handlers;
pub mod inflight;
pub mod jobs;
pub mod metering;
pub mod metrics;
pub mod openai;
pub mod prompt_caches;
pub mod responses;
pub mod routing;
pub mod serving;
pub mod telemetry;
pub mod upstream_usage;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::FutureExt;
use http::header::{CONTENT_LENGTH, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::Limited;
use hyper::body::{Body as _, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, error, info, info_span, warn};

pub use crate::app::{App, LoadedModel, ModelLoader, ModelRegistry, ModelState};
use crate::config::Config;
pub use auth::{Caller, KeyStore, Scope, Zone};
pub use body::{Body, BodyLimit, BoxError, ReqBody};
use connections::{ConnLimits, ReadDeadline};
pub use error::ApiError;
use inflight::{Concurrency, Guarded, Permit, SendWatch};
use metering::QuotaSlot;
use metrics::Metrics;
use serving::ServingThreads;

/// State shared by all requests: the application, and what the wire
/// itself keeps (metrics, per-key concurrency, the route table).
pub struct AppState {
    pub app: App,
    pub keys: KeyStore,
    pub metrics: Arc<Metrics>,
    /// Inference requests in progress per key, against `[server]` caps.
    pub concurrency: Arc<Concurrency>,
    /// Prompts being prepared (templated, tokenized) at once: one per core
    /// ([`openai::start_blocking`]).
    pub preparing: Arc<tokio::sync::Semaphore>,
    routes: Vec<Route>,
}

impl AppState {
    pub fn new(config: Config) -> Arc<Self> {
        let mut table = routes();
        table.extend(openai::routes());
        table.extend(anthropic::routes());
        table.extend(responses::routes());
        table.extend(admin_policies::routes());
        table.extend(routing::routes());
        table.extend(jobs::routes());
        table.extend(datasets::routes());
        table.extend(files::routes(&config));
        table.extend(prompt_caches::routes());
        table.extend(adapters::routes());
        table.extend(metering::routes());
        if config.test_routes {
            table.extend(handlers::test_routes());
        }
        // Last: API requests are matched before ever reaching them.
        if config.console.enabled {
            table.extend(console::routes());
        }
        let concurrency = Concurrency::new(
            config.server.max_concurrent_requests_per_key,
            &config.keys,
            &config.limits,
        );
        Arc::new(AppState {
            keys: KeyStore::new(config.keys.clone()),
            app: App::new(config),
            concurrency,
            preparing: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            metrics: Arc::default(),
            routes: table,
        })
    }
}

// ---------------------------------------------------------------- routing

pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, ApiError>> + Send>>;
pub type Handler = fn(Ctx, Request<ReqBody>) -> HandlerFuture;

/// Values of a route pattern's `{name}` segments, by name.
pub type RouteParams = Vec<(&'static str, String)>;

/// Per-request context handed to handlers next to the request.
pub struct Ctx {
    pub state: Arc<AppState>,
    /// Values of the `{name}` segments of the matched pattern.
    pub params: RouteParams,
    pub request_id: String,
    /// The connection's peer (for handlers whose access depends on it,
    /// such as `/metrics`).
    pub peer: SocketAddr,
}

impl Ctx {
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One entry of the route table.
pub struct Route {
    pub method: Method,
    /// `/`-separated; a `{name}` segment matches any one non-empty segment.
    pub pattern: &'static str,
    pub handler: Handler,
    /// Overrides the config's `max_body_bytes` for this route (e.g. uploads).
    pub body_limit: Option<u64>,
    /// A large upload, read as it streams: the body deadline bounds a
    /// stall (no data for `request_timeout_secs`), not the whole transfer.
    pub streamed_body: bool,
}

impl Route {
    pub fn new(method: Method, pattern: &'static str, handler: Handler) -> Self {
        Route {
            method,
            pattern,
            handler,
            body_limit: None,
            streamed_body: false,
        }
    }

    pub fn with_body_limit(mut self, bytes: u64) -> Self {
        self.body_limit = Some(bytes);
        self
    }

    /// A streamed upload of at most `bytes` ([`Route::streamed_body`]).
    pub fn with_streamed_body(mut self, bytes: u64) -> Self {
        self.body_limit = Some(bytes);
        self.streamed_body = true;
        self
    }

    fn matches(&self, path: &str) -> Option<RouteParams> {
        // Most patterns have no parameter: one comparison, no splitting
        // (every request is matched against the table in order).
        if !self.pattern.contains('{') {
            let same = self.pattern.trim_start_matches('/') == path.trim_start_matches('/');
            return same.then(Vec::new);
        }
        let mut params = Vec::new();
        let mut want = self.pattern.trim_start_matches('/').split('/');
        let mut got = path.trim_start_matches('/').split('/');
        loop {
            match (want.next(), got.next()) {
                (None, None) => return Some(params),
                (Some(w), Some(g)) => {
                    if let Some(name) = w.strip_prefix('{').and_then(|w| w.strip_suffix('}')) {
                        if g.is_empty() {
                            return None;
                        }
                        params.push((name, g.to_owned()));
                    } else if w != g {
                        return None;
                    }
                }
                _ => return None,
            }
        }
    }
}

/// The route table. Keep it sorted by path so it reads as an API index.
pub fn routes() -> Vec<Route> {
    vec![
        Route::new(Method::GET, "/healthz", |cx, req| {
            Box::pin(handlers::healthz(cx, req))
        }),
        Route::new(Method::GET, "/metrics", |cx, req| {
            Box::pin(handlers::metrics(cx, req))
        }),
        Route::new(Method::GET, "/readyz", |cx, req| {
            Box::pin(handlers::readyz(cx, req))
        }),
        Route::new(Method::GET, "/v1/models", |cx, req| {
            Box::pin(handlers::list_models(cx, req))
        }),
        Route::new(Method::GET, "/v1/models/{id}", |cx, req| {
            Box::pin(handlers::get_model(cx, req))
        }),
    ]
}

/// What routing decided, for logs and metrics.
struct Outcome {
    route: &'static str,
    caller: Option<Caller>,
    response: Response<Body>,
    /// The caller's concurrency slot, held until the answer's body is done.
    permit: Option<Permit>,
    /// An inference request (POST under `/v1/`): limited and metered.
    inference: bool,
}

async fn route(
    state: Arc<AppState>,
    req: Request<ReadDeadline<Incoming>>,
    request_id: String,
    peer: SocketAddr,
    keys: &auth::KeyMemo,
) -> Outcome {
    let mut outcome = Outcome {
        route: metrics::UNMATCHED,
        caller: None,
        response: Response::default(),
        permit: None,
        inference: false,
    };
    let (r, params, limit) = match admit(&state, &req, (peer, keys), &mut outcome) {
        Ok(admitted) => admitted,
        Err(e) => {
            outcome.response = error_response(req.uri().path(), e);
            return outcome;
        }
    };
    let mut req = req.map(|b| Limited::new(b, usize::try_from(limit).unwrap_or(usize::MAX)));
    req.extensions_mut().insert(BodyLimit(limit));
    if let Some(c) = outcome.caller.clone() {
        req.extensions_mut().insert(c);
    }
    // Inference under [limits]: the quota left goes out on the answer.
    let quota = (outcome.inference && !state.app.limits.is_empty()).then(QuotaSlot::default);
    if let Some(slot) = &quota {
        req.extensions_mut().insert(slot.clone());
    }
    let handler = r.handler;
    let cx = Ctx {
        state,
        params,
        request_id,
        peer,
    };
    outcome.response = call_handler(handler, cx, req).await;
    if let Some(q) = quota.as_ref().and_then(QuotaSlot::get) {
        metering::write_headers(outcome.response.headers_mut(), q);
    }
    outcome
}

/// Everything decided before a handler runs: who is calling (auth by URL
/// zone), which route, the caller's concurrency slot for inference work
/// (every POST under `/v1/`, taken before the body is read) and the body's
/// byte limit; or the refusal. Fills `outcome` as it learns.
fn admit<'s>(
    state: &'s AppState,
    req: &Request<ReadDeadline<Incoming>>,
    (peer, keys): (SocketAddr, &auth::KeyMemo),
    outcome: &mut Outcome,
) -> Result<(&'s Route, RouteParams, u64), ApiError> {
    let path = req.uri().path();
    let zone = Zone::of_path(path);
    if let Zone::Scoped(scope) = zone {
        let _auth = telemetry::span(telemetry::Step::Auth).entered();
        outcome.caller = Some(state.keys.authorize(req.headers(), scope, keys)?);
    }
    let (r, params) = match_route(&state.routes, req.method(), path, &mut outcome.route)?;
    if r.streamed_body {
        req.body().renew_on_progress();
    }
    outcome.inference = zone == Zone::Scoped(Scope::Infer) && r.method == Method::POST;
    if outcome.inference
        && let Some(c) = &outcome.caller
    {
        outcome.permit = state.concurrency.acquire(c, peer.ip())?;
    }
    let limit = r.body_limit.unwrap_or(state.app.config.max_body_bytes);
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    Ok((r, params, limit))
}

/// The route for `method` on `path`: 404, or 405 naming the methods the
/// path allows. `pattern` is set to the route's pattern as soon as the path
/// matches one (a 405 counts under it too).
fn match_route<'r>(
    routes: &'r [Route],
    method: &Method,
    path: &str,
    pattern: &mut &'static str,
) -> Result<(&'r Route, RouteParams), ApiError> {
    let mut allowed: Vec<&str> = Vec::new();
    for r in routes {
        if let Some(params) = r.matches(path) {
            *pattern = r.pattern;
            if r.method == method {
                return Ok((r, params));
            }
            allowed.push(r.method.as_str());
        }
    }
    let (method, path) = (method.to_string(), path.to_owned());
    Err(if allowed.is_empty() {
        ApiError::UnknownRoute { method, path }
    } else {
        ApiError::MethodNotAllowed {
            method,
            path,
            allowed: allowed.join(", "),
        }
    })
}

/// Runs a handler; its error, or a panic, becomes the error answer.
async fn call_handler(handler: Handler, cx: Ctx, req: Request<ReqBody>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    match AssertUnwindSafe(handler(cx, req)).catch_unwind().await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => error_response(&path, e),
        Err(panic) => {
            let what = crate::util::panic_message(&*panic);
            error!(panic = %what, "handler panicked");
            let e = ApiError::Internal("internal error; the server log has details".into());
            error_response(&path, e)
        }
    }
}

/// `e` in the error shape of the API `path` belongs to: Anthropic's on
/// its Messages paths, OpenAI's everywhere else.
fn error_response(path: &str, e: ApiError) -> Response<Body> {
    if anthropic::speaks(path) {
        anthropic::error_response(e)
    } else {
        e.into_response()
    }
}

// ---------------------------------------------------------------- requests

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Reuses the client's `x-request-id` when it is short and plain (so it can
/// be logged and echoed safely), otherwise makes one.
fn request_id(req: &Request<Incoming>) -> String {
    if let Some(v) = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        && (1..=128).contains(&v.len())
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    {
        return v.to_owned();
    }
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let nonce = *NONCE.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.finish()
    });
    // As `format!("{nonce:016x}{n:08x}")`, without the formatting machinery
    // (a thousand instructions, on every request).
    let mut id = String::with_capacity(24);
    push_hex(&mut id, nonce, 16);
    push_hex(&mut id, NEXT.fetch_add(1, Ordering::Relaxed), 8);
    id
}

/// Appends `value` in lower-case hex, at least `digits` digits.
fn push_hex(out: &mut String, value: u64, digits: u32) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let needed = (64 - value.leading_zeros()).div_ceil(4).max(digits);
    for i in (0..needed).rev() {
        out.push(char::from(HEX[(value >> (4 * i)) as usize & 15]));
    }
}

/// What a connection's requests share with it (one request at a time: HTTP/1).
#[derive(Debug, Default)]
struct ConnectionState {
    /// Whether the answer being sent waits on a client that stopped reading.
    watch: Arc<SendWatch>,
    /// The current request's body deadline: whether it fired, whether the
    /// route renews it; reset at each request's start.
    body: Arc<connections::BodyDeadline>,
    /// The key this connection last authenticated with.
    keys: auth::KeyMemo,
}

/// The whole life of one request: id, span, body deadline, auth and
/// routing, panic guard, metrics, access log; the answer's body carries the
/// caller's concurrency slot and reports to the connection's stall watch.
async fn handle(
    state: Arc<AppState>,
    req: Request<Incoming>,
    peer: SocketAddr,
    conn: Arc<ConnectionState>,
) -> Result<Response<Body>, Infallible> {
    let started = Instant::now();
    let _in_flight = state.metrics.start();
    let id = request_id(&req);
    let method = req.method().clone();
    let span = info_span!(
        "request",
        id = %id,
        method = %method,
        path = %req.uri().path(),
        peer = %peer,
        status = tracing::field::Empty
    );
    telemetry::adopt_parent(&span, req.headers());
    let timeout = state.app.config.server.request_timeout();
    conn.body.reset();
    let req = req.map(|b| ReadDeadline::new(b, started, timeout, Arc::clone(&conn.body)));
    let out = route(Arc::clone(&state), req, id.clone(), peer, &conn.keys)
        .instrument(span.clone())
        .await;
    let mut resp = out.response;
    if conn.body.expired.load(Ordering::Relaxed) {
        // Whatever the handler made of a body cut short, the answer is 408
        // (and the connection closes: the rest of the body is not coming).
        resp = ApiError::RequestTimeout {
            secs: timeout.as_secs(),
        }
        .into_response();
    }
    // A streamed answer holds the caller's slot until it is done and is
    // watched for a client that stops reading; a whole answer (of known
    // length) is done being made, so its slot is free as it goes out.
    let streamed = resp.body().size_hint().exact().is_none();
    let mut resp = if streamed {
        resp.map(|b| Guarded::wrap(b, Arc::clone(&conn.watch), out.permit))
    } else {
        resp
    };
    let status = resp.status().as_u16();
    if telemetry::enabled() {
        span.record("status", status);
    }
    let elapsed = started.elapsed();
    state.metrics.observe(&method, out.route, status, elapsed);
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(X_REQUEST_ID.clone(), v);
    }
    span.in_scope(|| {
        info!(
            route = out.route,
            status,
            elapsed_ms = elapsed.as_micros() as f64 / 1e3,
            key_id = out.caller.as_ref().map(|c| &*c.key_id),
            tenant = out.caller.as_ref().map(|c| &*c.tenant),
            "request done"
        )
    });
    Ok(resp)
}

// ---------------------------------------------------------------- serving

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {host}:{port}: {source}")]
    Bind {
        host: String,
        port: u16,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] crate::config::ConfigError),
    #[error("cannot start the serving threads: {0}")]
    Threads(std::io::Error),
}

/// Binds, starts loading the models with `load`, and serves until
/// SIGINT/SIGTERM.
pub async fn serve(config: Config, load: ModelLoader) -> Result<(), ServeError> {
    let tls = config.server.tls()?.map(TlsAcceptor::from);
    let (host, port) = (config.host.clone(), config.port);
    let bind_host = host.trim_start_matches('[').trim_end_matches(']');
    let listener = TcpListener::bind((bind_host, port))
        .await
        .map_err(|source| ServeError::Bind {
            host: host.clone(),
            port,
            source,
        })?;
    let state = AppState::new(config);
    state.app.start(load, shutdown_signal());
    run(listener, Arc::clone(&state), tls, shutdown_signal()).await?;
    state.app.stop().await;
    Ok(())
}

/// Serves `listener` until `shutdown` completes, then stops accepting and
/// gives in-flight requests up to `shutdown_grace` to finish.
///
/// Each connection is bounded (`[server]`): connections over the total or
/// per-IP cap are answered 503/429 and closed at once; an idle connection,
/// and a request head, get `keep_alive_timeout`; a connection whose client
/// stops reading a streamed answer for `stream_stall_timeout` is dropped,
/// which drops the answer and so cancels its generation. With `tls`, each
/// connection is served over TLS once its handshake completes (within the
/// keep-alive timeout).
pub async fn run(
    listener: TcpListener,
    state: Arc<AppState>,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let server = state.app.config.server.clone();
    let serving_threads = server.serving_threads();
    let threads = ServingThreads::start(serving_threads).map_err(ServeError::Threads)?;
    let limits = ConnLimits::new(
        connections::effective_max_connections(server.max_connections),
        server.max_connections_per_ip,
    );
    if let Ok(addr) = listener.local_addr() {
        let open = state.keys.is_empty();
        info!(
            %addr,
            tls = tls.is_some(),
            open_inference = open,
            serving_threads,
            max_connections = limits.max(),
            max_connections_per_ip = limits.per_ip(),
            "listening"
        );
    }
    let (keep_alive, stall) = (server.keep_alive_timeout(), server.stream_stall_timeout());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let permit = match limits.try_open(peer.ip()) {
                        Ok(p) => p,
                        Err(e) => {
                            tracing::debug!(%peer, error = %e, "connection refused");
                            limits.refuse(stream, e);
                            continue;
                        }
                    };
                    let times = (keep_alive, stall);
                    let conn = Accepted { stream, peer, permit };
                    serve_connection(&state, conn, tls.as_ref(), (&graceful, &threads), times);
                }
                Err(e) => {
                    // Usually out of file descriptors; back off instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    let grace = state.app.config.shutdown_grace;
    info!(
        grace_secs = grace.as_secs(),
        "shutting down: no new connections; waiting for in-flight requests"
    );
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => info!("all connections closed"),
        Err(_) => warn!("grace period over with requests still running; exiting anyway"),
    }
    Ok(())
}

/// A connection as accepted, with its slot in the connection limits.
struct Accepted {
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    permit: connections::ConnPermit,
}

/// Serves one accepted connection on its own task, holding its slot
/// until it ends, over TLS when `tls` is given: `times` are the keep-alive
/// (idle, head and TLS handshake) timeout and the stall bound of a
/// streamed answer.
fn serve_connection(
    state: &Arc<AppState>,
    conn: Accepted,
    tls: Option<&TlsAcceptor>,
    (graceful, threads): (&GracefulShutdown, &ServingThreads),
    (keep_alive, stall): (Duration, Duration),
) {
    // Answers go out as soon as they are written, as nginx's `tcp_nodelay
    // on` does for keep-alive clients; without it a small answer can wait
    // for the client's delayed ACK.
    if let Err(e) = conn.stream.set_nodelay(true) {
        tracing::debug!(peer = %conn.peer, error = %e, "cannot set TCP_NODELAY");
    }
    let Accepted {
        stream,
        peer,
        permit,
    } = conn;
    // Registered again, with the serving thread's reactor, when its task
    // first runs there.
    let stream = match stream.into_std() {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "cannot hand the connection over");
            return;
        }
    };
    let state = Arc::clone(state);
    let watcher = graceful.watcher();
    let acceptor = tls.cloned();
    threads.spawn(async move {
        let _permit = permit;
        let stream = match tokio::net::TcpStream::from_std(stream) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%peer, error = %e, "cannot serve the connection");
                return;
            }
        };
        let times = (keep_alive, stall);
        let Some(acceptor) = acceptor else {
            return serve_http(state, stream, peer, watcher, times).await;
        };
        match tokio::time::timeout(keep_alive, acceptor.accept(stream)).await {
            Ok(Ok(stream)) => serve_http(state, stream, peer, watcher, times).await,
            Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
        }
    });
}

/// Serves HTTP/1.1 on one connection's byte stream until it closes.
async fn serve_http<S>(
    state: Arc<AppState>,
    stream: S,
    peer: SocketAddr,
    watcher: hyper_util::server::graceful::Watcher,
    (keep_alive, stall): (Duration, Duration),
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let shared = Arc::new(ConnectionState::default());
    let watch = Arc::clone(&shared.watch);
    let service = service_fn(move |req| handle(Arc::clone(&state), req, peer, Arc::clone(&shared)));
    // hyper's header timer also runs while a kept-alive connection waits
    // for its next request: it is the idle timeout too.
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(keep_alive)
        .serve_connection(TokioIo::new(stream), service);
    match inflight::until_stalled(watcher.watch(conn), &watch, stall).await {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
        }
        None => warn!(
            %peer,
            stall_secs = stall.as_secs(),
            "client stopped reading a streamed answer; cancelled it and closed the connection"
        ),
    }
}

/// Completes on the first SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => info!("SIGINT received"),
        () = term => info!("SIGTERM received"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_ids_read_as_format_writes_them() {
        for (value, digits) in [(0u64, 8), (0xab, 8), (u64::MAX, 16), (1 << 40, 8), (7, 16)] {
            let mut ours = String::new();
            push_hex(&mut ours, value, digits);
            let theirs = format!("{value:0width$x}", width = digits as usize);
            assert_eq!(ours, theirs);
        }
    }

    use super::*;

    fn r(p: &'static str) -> Route {
        Route::new(Method::GET, p, |_, _| {
            Box::pin(async { Err(ApiError::Internal(String::new())) })
        })
    }

    #[test]
    fn pattern_matching() {
        assert_eq!(r("/healthz").matches("/healthz"), Some(vec![]));
        assert_eq!(r("/healthz").matches("/healthz/"), None);
        assert_eq!(r("/healthz").matches("//healthz"), Some(vec![]));
        assert_eq!(r("/v1/models").matches("/v1//models"), None);
        assert_eq!(r("/v1/models").matches("/v1/models/x"), None);
        assert_eq!(
            r("/v1/models/{id}").matches("/v1/models/abc"),
            Some(vec![("id", "abc".to_owned())])
        );
        assert_eq!(r("/v1/models/{id}").matches("/v1/models/"), None);
        assert_eq!(r("/v1/models/{id}").matches("/v1/models/a/b"), None);
    }
}
