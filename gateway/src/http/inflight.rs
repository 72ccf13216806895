//! What one caller may hold while its answers are in progress: a per-key cap
//! on concurrent inference requests, and a bound on how long an answer may
//! wait for a client that stopped reading.
//!
//! Both ride on the response body ([`Guarded`]), because a streamed answer
//! holds its batch slot until the body is done, long after the handler
//! returned: the permit is released and the stall watch cleared when the
//! body ends or is dropped (stream finished, client gone, or cut off).

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::Instant;

use super::auth::{ApiKey, Caller};
use super::body::{Body, BoxError};
use super::error::ApiError;
use crate::limits::{ANONYMOUS, LimitsConfig};

// ------------------------------------------------------ per-key concurrency

/// Inference requests in progress per API key (per client IP for open
/// inference) and per tenant, against their caps.
#[derive(Debug)]
pub struct Concurrency {
    default: u32,
    /// A counter per configured key, made at start: taking a key's slot is
    /// a lookup and an atomic add, nothing allocated or locked (it happens
    /// on every inference request, proxied ones included).
    keys: HashMap<String, Arc<Slots>, crate::util::FnvBuild>,
    /// A counter per tenant with a cap (`[limits]` tenants' or
    /// `default_tenant`'s `max_concurrent_requests`), shared by its keys.
    tenants: HashMap<String, Arc<Slots>, crate::util::FnvBuild>,
    /// Open-inference callers, by client IP.
    by_ip: Mutex<HashMap<String, u32>>,
}

/// One key's or tenant's cap and the slots in use.
#[derive(Debug)]
struct Slots {
    limit: u32,
    used: AtomicU32,
}

impl Slots {
    fn new(limit: u32) -> Arc<Slots> {
        Arc::new(Slots {
            limit,
            used: AtomicU32::new(0),
        })
    }

    /// Takes a slot; `false` when all are taken.
    fn take(&self) -> bool {
        let limit = self.limit;
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }
}

/// One request's slots; dropping it frees them.
#[derive(Debug)]
pub struct Permit {
    /// The key's or IP's slot, freed by its own drop.
    _caller: Option<Held>,
    tenant: Option<Arc<Slots>>,
}

#[derive(Debug)]
enum Held {
    Key(Arc<Slots>),
    Ip {
        owner: Arc<Concurrency>,
        who: String,
    },
}

impl Concurrency {
    /// `default` applies to keys without their own cap (`[limits.keys]` or
    /// the key's `max_concurrent_requests`) and to open-inference callers;
    /// 0 means no cap. Tenants are capped only where `limits` says.
    pub fn new(default: u32, keys: &[ApiKey], limits: &LimitsConfig) -> Arc<Self> {
        let key_cap = |k: &ApiKey| {
            limits
                .keys
                .get(&k.id)
                .and_then(|s| s.max_concurrent_requests)
                .or(k.max_concurrent_requests)
                .unwrap_or(default)
        };
        let keys_slots = keys
            .iter()
            .map(|k| (k.id.clone(), Slots::new(key_cap(k))))
            .collect();
        let tenants = keys
            .iter()
            .map(|k| k.tenant.as_str())
            .chain([ANONYMOUS])
            .filter_map(|t| Some((t.to_owned(), Slots::new(limits.tenant_concurrency(t)?))))
            .collect();
        Arc::new(Concurrency {
            default,
            keys: keys_slots,
            tenants,
            by_ip: Mutex::new(HashMap::new()),
        })
    }

    /// Takes a slot for `caller` (an anonymous caller is counted by `peer`)
    /// and for its tenant, or refuses with 429 when a cap is reached;
    /// `None` when uncapped.
    pub fn acquire(
        self: &Arc<Self>,
        caller: &Caller,
        peer: IpAddr,
    ) -> Result<Option<Permit>, ApiError> {
        let held = self.acquire_caller(caller, peer)?;
        let tenant = match self.tenants.get(&*caller.tenant) {
            Some(slots) if !slots.take() => {
                return Err(ApiError::ConcurrencyLimitExceeded {
                    who: format!("tenant '{}'", caller.tenant),
                    limit: slots.limit,
                });
            }
            Some(slots) => Some(Arc::clone(slots)),
            None => None,
        };
        Ok((held.is_some() || tenant.is_some()).then_some(Permit {
            _caller: held,
            tenant,
        }))
    }

    fn acquire_caller(
        self: &Arc<Self>,
        caller: &Caller,
        peer: IpAddr,
    ) -> Result<Option<Held>, ApiError> {
        if !caller.is_anonymous()
            && let Some(slots) = self.keys.get(&*caller.key_id)
        {
            if slots.limit == 0 {
                return Ok(None);
            }
            return match slots.take() {
                true => Ok(Some(Held::Key(Arc::clone(slots)))),
                false => Err(ApiError::ConcurrencyLimitExceeded {
                    who: format!("API key '{}'", caller.key_id),
                    limit: slots.limit,
                }),
            };
        }
        let limit = self.default;
        if limit == 0 {
            return Ok(None);
        }
        let who = format!("ip {}", peer.to_canonical());
        let mut counts = self.by_ip.lock().unwrap_or_else(|p| p.into_inner());
        let n = counts.entry(who.clone()).or_default();
        if *n >= limit {
            return Err(ApiError::ConcurrencyLimitExceeded { who, limit });
        }
        *n += 1;
        Ok(Some(Held::Ip {
            owner: Arc::clone(self),
            who,
        }))
    }

    fn release_ip(&self, who: &str) {
        let mut counts = self.by_ip.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = counts.get_mut(who) {
            *n -= 1;
            if *n == 0 {
                counts.remove(who);
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        match self {
            Held::Key(slots) => {
                slots.used.fetch_sub(1, Ordering::AcqRel);
            }
            Held::Ip { owner, who } => owner.release_ip(who),
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(slots) = &self.tenant {
            slots.used.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

// --------------------------------------------------------------- send stalls

/// Shared by a connection's task and the answer it is sending: when the
/// answer last handed data to hyper that hyper has not come back from.
///
/// hyper asks the body for its next frame as soon as it has room to buffer
/// it, so "handed a frame and not asked again" means the socket is full: the
/// client has stopped reading. Waiting on the engine is not a stall.
#[derive(Debug)]
pub struct SendWatch {
    epoch: Instant,
    /// Milliseconds after `epoch` (plus one) of the frame hyper has not come
    /// back from; 0 while hyper is asking or no answer is streaming.
    waiting_since: AtomicU64,
}

impl Default for SendWatch {
    fn default() -> Self {
        SendWatch {
            epoch: Instant::now(),
            waiting_since: AtomicU64::new(0),
        }
    }
}

impl SendWatch {
    fn handed(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64 + 1;
        self.waiting_since.store(ms, Ordering::Relaxed);
    }

    fn asked(&self) {
        self.waiting_since.store(0, Ordering::Relaxed);
    }

    fn waiting_since(&self) -> Option<Instant> {
        match self.waiting_since.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.epoch + Duration::from_millis(ms - 1)),
        }
    }
}

/// Runs a connection to its end (`Some` of its output), or until an answer
/// it is sending has waited `limit` for the client to take more data
/// (`None`; the connection is dropped, which cancels the answer).
///
/// The watch is read right after each poll of the connection, in the same
/// task that polls the answer's body: a frame handed and not asked for again
/// by the time the connection waits is a full socket, and only then is a
/// timer armed. A connection sending whole answers, or streaming tokens as
/// the engine makes them, never touches a timer.
pub async fn until_stalled<F: Future>(
    conn: F,
    watch: &SendWatch,
    limit: Duration,
) -> Option<F::Output> {
    let mut conn = std::pin::pin!(conn);
    let mut timer: Option<(Instant, Pin<Box<tokio::time::Sleep>>)> = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = conn.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        let Some(since) = watch.waiting_since() else {
            return Poll::Pending;
        };
        let due = since + limit;
        let sleep = match &mut timer {
            Some((armed, sleep)) => {
                if *armed != due {
                    sleep.as_mut().reset(due);
                    *armed = due;
                }
                sleep
            }
            None => {
                &mut timer
                    .insert((due, Box::pin(tokio::time::sleep_until(due))))
                    .1
            }
        };
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// A streamed response body: holds the request's concurrency [`Permit`]
/// until it is done, and reports to its connection's [`SendWatch`]. (A
/// whole answer is handed over in one frame and holds nothing while the
/// client reads it, so it goes out unwrapped.)
pub struct Guarded {
    inner: Body,
    watch: Arc<SendWatch>,
    _permit: Option<Permit>,
}

impl Guarded {
    pub fn wrap(inner: Body, watch: Arc<SendWatch>, permit: Option<Permit>) -> Body {
        Guarded {
            inner,
            watch,
            _permit: permit,
        }
        .boxed_unsync()
    }
}

impl HttpBody for Guarded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        this.watch.asked();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled
            && !this.inner.is_end_stream()
        {
            this.watch.handed();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.watch.asked();
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::http::auth::Scope;

    fn key(id: &str, cap: Option<u32>) -> ApiKey {
        ApiKey {
            max_concurrent_requests: cap,
            ..ApiKey::for_test(id, &[Scope::Infer], id)
        }
    }

    fn caller(id: &str) -> Caller {
        Caller {
            key_id: id.into(),
            tenant: "t".into(),
            scopes: [Scope::Infer].into(),
        }
    }

    #[test]
    fn per_key_caps_with_overrides() {
        let c = Concurrency::new(
            2,
            &[key("a", None), key("b", Some(1)), key("c", Some(0))],
            &LimitsConfig::default(),
        );
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let a1 = c.acquire(&caller("a"), ip).unwrap();
        let _a2 = c.acquire(&caller("a"), ip).unwrap();
        let e = c.acquire(&caller("a"), ip).unwrap_err();
        assert_eq!(e.code(), "concurrency_limit_exceeded");
        assert_eq!(e.status(), 429);
        let _b1 = c.acquire(&caller("b"), ip).unwrap();
        assert!(c.acquire(&caller("b"), ip).is_err());
        for _ in 0..10 {
            assert!(c.acquire(&caller("c"), ip).unwrap().is_none());
        }
        drop(a1);
        assert!(c.acquire(&caller("a"), ip).is_ok());
    }

    #[test]
    fn a_tenant_cap_is_shared_by_its_keys_and_frees_with_them() {
        let limits: LimitsConfig =
            toml::from_str("[tenants.t]\nmax_concurrent_requests = 2\n").unwrap();
        let c = Concurrency::new(0, &[key("a", None), key("b", Some(1))], &limits);
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let a1 = c.acquire(&caller("a"), ip).unwrap();
        let b1 = c.acquire(&caller("b"), ip).unwrap();
        let e = c.acquire(&caller("a"), ip).unwrap_err();
        assert!(e.to_string().contains("tenant 't'"), "{e}");
        drop(b1);
        // The tenant's slot is back, and the key's own cap was not taken
        // by the refused request.
        let b2 = c.acquire(&caller("b"), ip).unwrap();
        assert!(c.acquire(&caller("b"), ip).is_err());
        drop((a1, b2));
        assert!(c.acquire(&caller("a"), ip).unwrap().is_some());
    }

    #[test]
    fn open_inference_is_capped_per_ip() {
        let c = Concurrency::new(1, &[], &LimitsConfig::default());
        let anon = Caller {
            key_id: Caller::ANONYMOUS.into(),
            tenant: Caller::ANONYMOUS.into(),
            scopes: [Scope::Infer].into(),
        };
        let one = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1));
        let two = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let _p = c.acquire(&anon, one).unwrap();
        assert!(c.acquire(&anon, one).is_err());
        assert!(c.acquire(&anon, two).is_ok());
    }

    /// A stand-in for hyper's connection: asks `body` for frames while
    /// `reading` says the client takes them, and otherwise stops asking.
    async fn connection(mut body: Body, reading: Arc<std::sync::atomic::AtomicBool>) {
        loop {
            if reading.load(Ordering::Relaxed) {
                if body.frame().await.is_none() {
                    return;
                }
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    #[tokio::test]
    async fn stall_is_data_not_taken_not_engine_waits() {
        let limit = Duration::from_millis(100);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Frame<Bytes>, BoxError>>();
        let frames = futures_util::stream::unfold(rx, |mut rx| async move {
            let f = rx.recv().await?;
            Some((f, rx))
        });
        let watch = Arc::new(SendWatch::default());
        let body = Guarded::wrap(
            http_body_util::StreamBody::new(Box::pin(frames)).boxed_unsync(),
            watch.clone(),
            None,
        );
        let reading = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let conn = tokio::spawn({
            let (watch, reading) = (watch.clone(), reading.clone());
            async move { until_stalled(connection(body, reading), &watch, limit).await }
        });
        // The engine is slow (no frame for 3 limits) and the client reads
        // every frame: never a stall.
        tokio::time::sleep(limit * 3).await;
        for _ in 0..5 {
            tx.send(Ok(Frame::data(Bytes::from_static(b"x")))).unwrap();
            tokio::time::sleep(limit / 2).await;
        }
        assert!(!conn.is_finished(), "cut off while the client was reading");
        // The client stops reading: the next frame is handed and never
        // followed by another ask, so the connection is cut after `limit`.
        reading.store(false, Ordering::Relaxed);
        tx.send(Ok(Frame::data(Bytes::from_static(b"x")))).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(Ok(Frame::data(Bytes::from_static(b"y")))).unwrap();
        let started = Instant::now();
        let ended = tokio::time::timeout(limit * 5, conn).await;
        assert!(matches!(ended, Ok(Ok(None))), "stalled: {ended:?}");
        assert!(started.elapsed() >= limit / 2);
    }
}
