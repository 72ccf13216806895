//! Connection-level limits: how many connections may be open (in all and
//! per client IP), the file-descriptor budget behind that cap, the quick
//! refusal of connections over it, and the deadline for a request's body.
//!
//! Hand-written rather than tower/tower-http layers: the caps act at
//! `accept` (before hyper sees the connection) and the body deadline must
//! cover the whole body, not the gap between two frames (tower-http's
//! `TimeoutBody`), so neither fits a service layer; each is a few lines here.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tracing::{info, warn};

use super::body::BoxError;
use super::error::{ApiError, RETRY_AFTER_SECS};

// ------------------------------------------------------------ connection caps

/// Open connections, in all and per client IP.
#[derive(Debug)]
pub struct ConnLimits {
    max: usize,
    per_ip: usize,
    open: Mutex<Open>,
    /// Refusals being written now ([`ConnLimits::refuse`]).
    refusing: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_ip: HashMap<IpAddr, usize>,
}

/// One admitted connection; dropping it (connection task over) frees its slot.
#[derive(Debug)]
pub struct ConnPermit {
    limits: Arc<ConnLimits>,
    ip: IpAddr,
}

impl ConnLimits {
    pub fn new(max: usize, per_ip: usize) -> Arc<Self> {
        Arc::new(ConnLimits {
            max: max.max(1),
            per_ip: per_ip.clamp(1, max.max(1)),
            open: Mutex::new(Open::default()),
            refusing: Arc::new(AtomicUsize::new(0)),
        })
    }

    pub fn max(&self) -> usize {
        self.max
    }

    pub fn per_ip(&self) -> usize {
        self.per_ip
    }

    /// Admits a connection from `ip`, or says which cap it is over.
    pub fn try_open(self: &Arc<Self>, ip: IpAddr) -> Result<ConnPermit, ApiError> {
        let ip = ip.to_canonical();
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.total >= self.max {
            return Err(ApiError::TooManyConnections { limit: self.max });
        }
        let n = open.by_ip.entry(ip).or_default();
        if *n >= self.per_ip {
            return Err(ApiError::TooManyConnectionsFromIp { limit: self.per_ip });
        }
        *n += 1;
        open.total += 1;
        Ok(ConnPermit {
            limits: Arc::clone(self),
            ip,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).total
    }
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        let mut open = self.limits.open.lock().unwrap_or_else(|p| p.into_inner());
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.by_ip.remove(&self.ip);
            }
        }
    }
}

// ------------------------------------------------------ file descriptor budget

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the default soft
/// limit, often 1024, is far below what a server needs) and returns the
/// soft limit in force afterwards; `None` where it cannot be read.
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux and macOS
pub fn raise_fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit only read or write the struct passed.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            // macOS refuses more than OPEN_MAX for an unlimited hard limit.
            let want = if lim.rlim_max == libc::RLIM_INFINITY {
                1 << 20
            } else {
                lim.rlim_max
            };
            for target in [want, 10_240] {
                let new = libc::rlimit {
                    rlim_cur: target.max(lim.rlim_cur),
                    rlim_max: lim.rlim_max,
                };
                // SAFETY: as above.
                if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0 {
                    lim.rlim_cur = new.rlim_cur;
                    break;
                }
            }
        }
        Some(lim.rlim_cur as u64)
    }
    #[cfg(not(unix))]
    None
}

/// Connections that `fd_limit` descriptors leave room for: a reserve
/// (an eighth, at least 64) for model, policy and job files, the listener
/// and refusals in progress, then half of the rest, since a proxied request
/// opens a second socket to its upstream.
pub fn connection_budget(fd_limit: u64) -> usize {
    let reserve = (fd_limit / 8).max(64);
    (fd_limit.saturating_sub(reserve) / 2).max(1) as usize
}

/// The connection cap in force: `configured`, lowered to what the
/// descriptor limit allows (raised to its hard limit first).
pub fn effective_max_connections(configured: usize) -> usize {
    let Some(fds) = raise_fd_limit() else {
        return configured;
    };
    let budget = connection_budget(fds);
    if budget < configured {
        warn!(
            configured,
            fd_limit = fds,
            max_connections = budget,
            "[server] max_connections lowered to fit the open-file limit; raise `ulimit -n` to allow more"
        );
        budget
    } else {
        info!(
            fd_limit = fds,
            max_connections = configured,
            "connection cap"
        );
        configured
    }
}

// ------------------------------------------------------------------- refusals

/// Refusals being written at once; connections beyond are closed unanswered,
/// so a flood cannot turn refusals into a second way to run out of descriptors.
const MAX_REFUSING: usize = 64;

impl ConnLimits {
    /// Answers a connection over a cap with `err` (503/429, `Retry-After`) and
    /// closes it, in a task bounded to a few seconds. The request head is read
    /// first (up to a second) so the answer is not lost to a reset, and a
    /// liveness probe (`GET /healthz`) still gets its 200: a busy server is alive,
    /// and must not be restarted for being busy.
    pub fn refuse(&self, stream: TcpStream, err: ApiError) {
        if self.refusing.fetch_add(1, Ordering::AcqRel) >= MAX_REFUSING {
            self.refusing.fetch_sub(1, Ordering::AcqRel);
            return; // dropping `stream` closes it
        }
        struct Slot(Arc<AtomicUsize>);
        impl Drop for Slot {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let slot = Slot(Arc::clone(&self.refusing));
        tokio::spawn(async move {
            let _slot = slot;
            let _ =
                tokio::time::timeout(Duration::from_secs(3), answer_and_close(stream, err)).await;
        });
    }
}

async fn answer_and_close(mut stream: TcpStream, err: ApiError) {
    let mut buf = [0u8; 4096];
    let mut n = 0;
    let read_head = async {
        while n < buf.len() {
            match stream.read(&mut buf[n..]).await {
                Ok(0) | Err(_) => break,
                Ok(k) => n += k,
            }
            if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), read_head).await;
    let answer = if is_health_probe(&buf[..n]) {
        raw_response(200, "OK", &[], br#"{"status":"ok"}"#)
    } else {
        let reason = err.status().canonical_reason().unwrap_or("");
        raw_response(
            err.status().as_u16(),
            reason,
            &[("retry-after", RETRY_AFTER_SECS)],
            &err.to_json(),
        )
    };
    if stream.write_all(&answer).await.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    // Read what the client still sends until it closes, so our close does
    // not reset the connection before it has read the answer.
    let drain = async { while matches!(stream.read(&mut buf).await, Ok(k) if k > 0) {} };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

fn is_health_probe(head: &[u8]) -> bool {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, target) = (parts.next(), parts.next().unwrap_or_default());
    method == Some(&b"GET"[..]) && (target == b"/healthz" || target.starts_with(b"/healthz?"))
}

fn raw_response(status: u16, reason: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

// -------------------------------------------------------------- body deadline

/// The error a [`ReadDeadline`] body fails with; mapped to 408.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {secs} s")]
pub struct BodyTimedOut {
    pub secs: u64,
}

/// What a request body's deadline shares with the dispatcher (one per
/// connection, reset at each request).
#[derive(Debug, Default)]
pub struct BodyDeadline {
    /// Set when the deadline fired (answer 408, close).
    pub expired: AtomicBool,
    /// Set by routes that take large uploads: each piece of the body that
    /// arrives moves the deadline on, so the limit bounds a stall, not the
    /// whole transfer.
    pub renew_on_progress: AtomicBool,
}

impl BodyDeadline {
    pub fn reset(&self) {
        self.expired.store(false, Ordering::Relaxed);
        self.renew_on_progress.store(false, Ordering::Relaxed);
    }
}

/// A request body that fails with [`BodyTimedOut`] once its deadline
/// passes, so a client trickling (or withholding) its body cannot hold a
/// handler, a connection and a concurrency slot for longer than that.
pub struct ReadDeadline<B> {
    inner: B,
    deadline: Instant,
    timeout: Duration,
    /// Made on the first wait: most bodies arrive with their head.
    sleep: Option<Pin<Box<Sleep>>>,
    shared: Arc<BodyDeadline>,
}

impl<B> ReadDeadline<B> {
    /// The body must have arrived `timeout` after `started` (when the
    /// request's head was read).
    pub fn new(
        inner: B,
        started: std::time::Instant,
        timeout: Duration,
        shared: Arc<BodyDeadline>,
    ) -> Self {
        ReadDeadline {
            inner,
            deadline: Instant::from_std(started) + timeout,
            timeout,
            sleep: None,
            shared,
        }
    }

    /// From now on, each piece of the body that arrives gives the rest
    /// another full timeout (see [`BodyDeadline::renew_on_progress`]).
    pub fn renew_on_progress(&self) {
        self.shared.renew_on_progress.store(true, Ordering::Relaxed);
    }
}

impl<B> HttpBody for ReadDeadline<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let secs = this.timeout.as_secs();
        if this.shared.expired.load(Ordering::Relaxed) {
            return Poll::Ready(Some(Err(BodyTimedOut { secs }.into())));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                if frame.is_some() && this.shared.renew_on_progress.load(Ordering::Relaxed) {
                    this.deadline = Instant::now() + this.timeout;
                    if let Some(sleep) = this.sleep.as_mut() {
                        sleep.as_mut().reset(this.deadline);
                    }
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let deadline = this.deadline;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if sleep.as_mut().poll(cx).is_ready() {
                    this.shared.expired.store(true, Ordering::Relaxed);
                    return Poll::Ready(Some(Err(BodyTimedOut { secs }.into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use http_body_util::{BodyExt, Full, StreamBody};

    use super::*;

    #[test]
    fn caps_total_and_per_ip_and_free_on_drop() {
        let limits = ConnLimits::new(3, 2);
        let a = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let b = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
        let a1 = limits.try_open(a).unwrap();
        let _a2 = limits.try_open(a).unwrap();
        let e = limits.try_open(a).unwrap_err();
        assert!(matches!(e, ApiError::TooManyConnectionsFromIp { limit: 2 }));
        assert_eq!(e.status(), 429);
        let _b1 = limits.try_open(b).unwrap();
        let e = limits.try_open(b).unwrap_err();
        assert_eq!(e.status(), 503, "{e}");
        drop(a1);
        assert_eq!(limits.open(), 2);
        // IPv4-mapped IPv6 is the same client.
        let mapped = IpAddr::V6(Ipv4Addr::new(127, 0, 0, 2).to_ipv6_mapped());
        let _a3 = limits.try_open(mapped).unwrap();
        assert!(limits.try_open(a).is_err());
    }

    #[test]
    fn budget_keeps_a_reserve() {
        assert_eq!(connection_budget(256), 96);
        assert_eq!(connection_budget(20_000), 8750);
        assert_eq!(connection_budget(10), 1);
    }

    #[test]
    fn health_probe_detection() {
        assert!(is_health_probe(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"));
        assert!(is_health_probe(b"GET /healthz?x=1 HTTP/1.1\r\n"));
        assert!(!is_health_probe(b"GET /healthzz HTTP/1.1\r\n"));
        assert!(!is_health_probe(b"POST /healthz HTTP/1.1\r\n"));
        assert!(!is_health_probe(b""));
    }

    #[tokio::test]
    async fn body_deadline_fires_on_a_stalled_body_only() {
        let limit = Duration::from_millis(200);
        let whole = Full::new(Bytes::from_static(b"abc"));
        let flag = Arc::new(BodyDeadline::default());
        let body = ReadDeadline::new(whole, std::time::Instant::now(), limit, flag.clone());
        assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"abc");
        assert!(!flag.expired.load(Ordering::Relaxed));

        let first =
            futures_util::stream::iter([Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"a")))]);
        let stalled = StreamBody::new(futures_util::StreamExt::chain(
            first,
            futures_util::stream::pending(),
        ));
        let body = ReadDeadline::new(stalled, std::time::Instant::now(), limit, flag.clone());
        let started = Instant::now();
        let err = body.collect().await.unwrap_err();
        assert!(err.downcast_ref::<BodyTimedOut>().is_some(), "{err}");
        assert!(flag.expired.load(Ordering::Relaxed));
        assert!(started.elapsed() >= limit);
    }
}
