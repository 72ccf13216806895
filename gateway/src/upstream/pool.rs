//! Keep-alive HTTP/1 connections to one upstream, driven on the request's
//! own task.
//!
//! Each connection is a hyper `client::conn::http1` pair (`SendRequest`,
//! `Connection`). Nobody polls an idle connection: it waits in the pool
//! until a request checks it out, and that request's task then polls the
//! `Connection` itself, first while waiting for the answer's head and then
//! from the response body it hands to the server ([`Lease::poll_conn`]). So
//! a proxied request never crosses to another task or thread, and no task
//! is spawned per request or per connection. When the answer's body is
//! complete the connection goes back to the pool; a body dropped early (the
//! client went away) closes it.
//!
//! A pooled connection the upstream has closed is noticed at checkout (one
//! poll sees the EOF) or by the sweeper, which also drops connections idle
//! for longer than [`IDLE_TIMEOUT`]. If a reused connection still fails
//! before any of the answer arrived (the upstream closed it as we sent),
//! the request is sent once more on a new connection.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Idle connections kept per upstream; more are closed when they come back.
pub(super) const MAX_IDLE: usize = 128;
/// An idle connection older than this is closed.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the sweeper looks at idle connections.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

type Conn = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One connection, owned by whoever holds it: the pool or one exchange.
pub(super) struct Lease {
    sender: http1::SendRequest<Full<Bytes>>,
    conn: Pin<Box<Conn>>,
    /// The connection future completed (closed or failed): never reused.
    done: bool,
    /// Taken from the pool rather than made for this request.
    pub(super) reused: bool,
    idle_since: Instant,
}

impl Lease {
    /// Drives the connection: writes the request, reads the answer into the
    /// response body's channel, notices EOF. Call before and after polling
    /// the response future or body.
    pub(super) fn poll_conn(&mut self, cx: &mut Context<'_>) {
        if !self.done && self.conn.as_mut().poll(cx).is_ready() {
            self.done = true;
        }
    }

    /// Whether the connection can take another request right now.
    fn reusable(&mut self, cx: &mut Context<'_>) -> bool {
        self.poll_conn(cx);
        !self.done && !self.sender.is_closed() && self.sender.is_ready()
    }

    /// Sends `req` and waits for the answer's head, driving the connection
    /// on this task meanwhile.
    pub(super) async fn send(
        &mut self,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, hyper::Error> {
        let Lease {
            sender, conn, done, ..
        } = self;
        let mut answer = std::pin::pin!(sender.send_request(req));
        poll_fn(|cx| {
            // The answer first: the connection may have delivered it already.
            if let Poll::Ready(r) = answer.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            if !*done && conn.as_mut().poll(cx).is_ready() {
                *done = true;
            }
            answer.as_mut().poll(cx)
        })
        .await
    }
}

/// Idle connections of one upstream, most recently used last.
#[derive(Default)]
pub(super) struct Pool {
    idle: Mutex<Vec<Lease>>,
    sweeping: AtomicBool,
}

impl Pool {
    /// The most recently used idle connection that is still open, if any.
    pub(super) fn checkout(&self) -> Option<Lease> {
        let mut cx = Context::from_waker(Waker::noop());
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
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
        if !lease.reusable(&mut cx) {
            return;
        }
        lease.idle_since = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() >= MAX_IDLE {
            // Keep the most recently used ones: drop the oldest.
            idle.remove(0);
        }
        idle.push(lease);
        drop(idle);
        if !self.sweeping.swap(true, Ordering::Relaxed)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(sweeper(Arc::downgrade(self)));
        }
    }

    /// Closes idle connections that expired or that the upstream closed.
    fn sweep(&self) {
        let mut cx = Context::from_waker(Waker::noop());
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain_mut(|l| l.idle_since.elapsed() < IDLE_TIMEOUT && l.reusable(&mut cx));
    }

    /// Idle connections now (tests and diagnostics).
    pub(super) fn idle_count(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
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

/// Opens a new connection to `authority` (`host:port`).
pub(super) async fn connect(authority: &str) -> Result<Lease, std::io::Error> {
    let stream = TcpStream::connect(authority).await?;
    // Small request/response exchanges: don't wait for Nagle.
    stream.set_nodelay(true)?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    Ok(Lease {
        sender,
        conn: Box::pin(conn),
        done: false,
        reused: false,
        idle_since: Instant::now(),
    })
}
