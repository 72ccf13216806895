//! Connections to one upstream: keep-alive HTTP/1.1 connections driven on
//! the request's own task, or one shared HTTP/2 connection when a TLS
//! upstream chooses HTTP/2 by ALPN; plain TCP or TLS (rustls) underneath.
//!
//! An HTTP/1.1 connection ([`H1`], h1.rs) is only read and written by the
//! request that holds it: nobody polls an idle connection; it waits in the
//! pool (the serving thread's part of it) until a request checks it out,
//! which writes its request, reads the answer's head, and hands the server
//! a body that reads the rest from the socket as it is polled. So a
//! proxied request never crosses to another task or thread, and no task is
//! spawned per request or per connection. When the answer's body is
//! complete the connection goes back to the pool; a body dropped early (the
//! client went away) closes it.
//!
//! A pooled connection the upstream has closed is noticed at checkout (one
//! poll sees the EOF) or by the sweeper, which also drops connections idle
//! for longer than [`IDLE_TIMEOUT`]. If a reused connection still fails
//! before any of the answer arrived (the upstream closed it as we sent),
//! the request is sent once more on a new connection.
//!
//! HTTP/2 multiplexes every exchange on one connection, so no single
//! request can drive it: it runs on a task of its own, and a lease is a
//! handle on it. It is replaced when the upstream closes it.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::h1::H1;
use crate::util::BoxError;
use crate::util::threads::slot;

/// Idle connections kept per upstream and serving thread; more are closed
/// when they come back.
pub(super) const MAX_IDLE: usize = 128;
/// An idle connection older than this is closed.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the sweeper looks at idle connections.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// How one exchange talks to the upstream.
enum Link {
    /// An HTTP/1.1 connection this lease owns and drives (h1.rs).
    H1(H1),
    /// A handle on the upstream's shared HTTP/2 connection, which its own
    /// task drives (it multiplexes every exchange at once). HTTP/2 wants
    /// the absolute URI: `origin` is its scheme and authority.
    H2 {
        sender: http2::SendRequest<Full<Bytes>>,
        origin: Uri,
    },
}

/// One connection (or one stream of a shared HTTP/2 one), owned by
/// whoever holds it: the pool or one exchange.
pub(super) struct Lease {
    link: Link,
    /// Taken from the pool rather than made for this request.
    pub(super) reused: bool,
    idle_since: Instant,
}

/// An answer's body: read from the lease's own HTTP/1.1 connection, or
/// hyper's body of an HTTP/2 stream.
pub(super) enum Reply {
    H1,
    H2(Incoming),
}

impl Lease {
    /// Whether the connection can take another request right now.
    fn reusable(&mut self, cx: &mut Context<'_>) -> bool {
        match &mut self.link {
            Link::H1(conn) => conn.reusable(cx),
            Link::H2 { sender, .. } => !sender.is_closed(),
        }
    }

    /// Whether an HTTP/1.1 answer's body is read whole (an HTTP/2 lease
    /// carries no body).
    pub(super) fn is_done(&self) -> bool {
        match &self.link {
            Link::H1(conn) => conn.is_done(),
            Link::H2 { .. } => true,
        }
    }

    /// An HTTP/1.1 answer's body bytes still to come, when known.
    pub(super) fn remaining(&self) -> Option<u64> {
        match &self.link {
            Link::H1(conn) => conn.remaining(),
            Link::H2 { .. } => Some(0),
        }
    }

    /// The HTTP/1.1 connection, if this is one.
    pub(super) fn h1(&mut self) -> Option<&mut H1> {
        match &mut self.link {
            Link::H1(conn) => Some(conn),
            Link::H2 { .. } => None,
        }
    }

    /// Sends `req` and waits for the answer's head.
    pub(super) async fn send(
        &mut self,
        mut req: Request<Bytes>,
    ) -> Result<Response<Reply>, BoxError> {
        match &mut self.link {
            Link::H1(conn) => Ok(conn.exchange(&req).await?.map(|()| Reply::H1)),
            Link::H2 { sender, origin } => {
                let mut uri = origin.clone().into_parts();
                uri.path_and_query = req.uri().path_and_query().cloned();
                if let Ok(absolute) = Uri::from_parts(uri) {
                    *req.uri_mut() = absolute;
                }
                // `host` is HTTP/1's; HTTP/2 carries it as `:authority`.
                req.headers_mut().remove(http::header::HOST);
                sender.ready().await?;
                let resp = sender.send_request(req.map(Full::new)).await?;
                Ok(resp.map(Reply::H2))
            }
        }
    }
}

#[derive(Default)]
pub(super) struct Pool {
    /// Idle HTTP/1 connections by the serving thread that opened them
    /// (`util::threads::slot`): a request reuses only its own thread's, whose
    /// reactor drives them.
    idle: Mutex<Vec<Vec<Lease>>>,
    /// The HTTP/2 connection, when the upstream chose HTTP/2: every
    /// exchange shares it.
    shared: Mutex<Option<(http2::SendRequest<Full<Bytes>>, Uri)>>,
    /// Whether `shared` may hold a connection: HTTP/1 upstreams never take
    /// its lock.
    has_shared: AtomicBool,
    sweeping: AtomicBool,
}

impl Pool {
    /// A stream on the shared HTTP/2 connection, or else the most recently
    /// used idle HTTP/1 connection that is still open, if any.
    pub(super) fn checkout(&self) -> Option<Lease> {
        if self.has_shared.load(Ordering::Relaxed) {
            return self.checkout_shared().or_else(|| self.checkout_idle());
        }
        self.checkout_idle()
    }

    /// A stream on the shared HTTP/2 connection, if it is still open.
    fn checkout_shared(&self) -> Option<Lease> {
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((sender, origin)) = shared.as_ref() {
            if !sender.is_closed() {
                return Some(Lease {
                    link: Link::H2 {
                        sender: sender.clone(),
                        origin: origin.clone(),
                    },
                    reused: true,
                    idle_since: Instant::now(),
                });
            }
            *shared = None;
        }
        None
    }

    /// The most recently used idle HTTP/1 connection still open, if any.
    fn checkout_idle(&self) -> Option<Lease> {
        let mut cx = Context::from_waker(Waker::noop());
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let idle = idle.get_mut(slot())?;
        while let Some(mut lease) = idle.pop() {
            if lease.idle_since.elapsed() < IDLE_TIMEOUT && lease.reusable(&mut cx) {
                lease.reused = true;
                return Some(lease);
            }
        }
        None
    }

    /// Returns a connection whose exchange is complete (closed instead when
    /// it cannot take another request). Starts the sweeper on first use.
    pub(super) fn checkin(self: &Arc<Self>, mut lease: Lease) {
        let mut cx = Context::from_waker(Waker::noop());
        if matches!(lease.link, Link::H2 { .. }) || !lease.reusable(&mut cx) {
            // An HTTP/2 stream is done; its connection stays shared.
            return;
        }
        lease.idle_since = Instant::now();
        let mut shards = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = slot();
        if shards.len() <= slot {
            shards.resize_with(slot + 1, Vec::new);
        }
        let idle = &mut shards[slot];
        if idle.len() >= MAX_IDLE {
            // Keep the most recently used ones: drop the oldest.
            idle.remove(0);
        }
        idle.push(lease);
        drop(shards);
        if !self.sweeping.swap(true, Ordering::Relaxed)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(sweeper(Arc::downgrade(self)));
        }
    }

    /// Closes idle connections that expired or that the upstream closed.
    fn sweep(&self) {
        let mut cx = Context::from_waker(Waker::noop());
        let mut shards = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        for idle in shards.iter_mut() {
            idle.retain_mut(|l| l.idle_since.elapsed() < IDLE_TIMEOUT && l.reusable(&mut cx));
        }
    }

    /// Idle connections now (tests and diagnostics).
    pub(super) fn idle_count(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(Vec::len)
            .sum()
    }
}

/// Sweeps the pool every [`SWEEP_EVERY`] until the upstream is dropped.
async fn sweeper(pool: Weak<Pool>) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    loop {
        every.tick().await;
        let Some(p) = pool.upgrade() else { return };
        p.sweep();
    }
}

/// How to reach an upstream: its `host:port`, and for `https://` the TLS
/// client and the name its certificate must carry.
pub(super) struct Dialer {
    pub(super) authority: String,
    pub(super) tls: Option<(TlsConnector, ServerName<'static>)>,
    /// `https://host:port`, the origin of HTTP/2 requests.
    pub(super) origin: Uri,
}

/// Why no connection could be made: a fixed phrase for the client, the
/// cause (which may name the address) for the log.
pub(super) struct ConnectError {
    pub(super) reason: &'static str,
    pub(super) detail: String,
}

impl Pool {
    /// Opens a new connection; over TLS, HTTP/2 when the upstream chooses
    /// it by ALPN (that connection then becomes the shared one and is
    /// driven by its own task), HTTP/1.1 otherwise.
    pub(super) async fn connect(&self, dialer: &Dialer) -> Result<Lease, ConnectError> {
        let failed = |reason, e: &dyn std::fmt::Display| ConnectError {
            reason,
            detail: format!("{reason} ({}): {e}", dialer.authority),
        };
        let tcp = TcpStream::connect(&dialer.authority)
            .await
            .map_err(|e| failed("cannot connect", &e))?;
        // Small request/response exchanges: don't wait for Nagle.
        tcp.set_nodelay(true)
            .map_err(|e| failed("cannot connect", &e))?;
        let stream = match &dialer.tls {
            None => Stream::Plain(tcp),
            Some((connector, name)) => {
                let tls = connector
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| failed("TLS handshake failed", &e))?;
                Stream::Tls(Box::new(tls))
            }
        };
        let link = if stream.negotiated_h2() {
            let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .map_err(|e| failed("the HTTP/2 handshake failed", &e))?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream HTTP/2 connection ended");
                }
            });
            *self.shared.lock().unwrap_or_else(PoisonError::into_inner) =
                Some((sender.clone(), dialer.origin.clone()));
            self.has_shared.store(true, Ordering::Relaxed);
            Link::H2 {
                sender,
                origin: dialer.origin.clone(),
            }
        } else {
            Link::H1(H1::new(stream))
        };
        Ok(Lease {
            link,
            reused: false,
            idle_since: Instant::now(),
        })
    }
}

/// A connection's byte stream: plain TCP or TLS over it.
pub(super) enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    fn negotiated_h2(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(tls) => tls.get_ref().1.alpn_protocol() == Some(b"h2"),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
