//! The threads that run request-time guest calls (routers and adapter
//! selectors), so a guest that spends its whole deadline never holds an
//! async worker: the request path hands the call over and awaits a oneshot.
//!
//! Bounded twice: [`HostConfig::call_threads`] threads (not tokio's blocking
//! pool, whose 512 threads would let hostile guests take every core) and a
//! queue of [`HostConfig::call_queue`] calls waiting for one. A call that
//! finds the queue full fails at once with [`FailureKind::Capacity`], like a
//! guest failure, so the policy's `fail_open` / `fail_closed` applies. The
//! longest a queued call waits is about `call_queue / call_threads` times the
//! largest request-time deadline ([`HostConfig::max_request_deadline_ms`]).
//!
//! [`HostConfig::call_threads`]: super::HostConfig::call_threads
//! [`HostConfig::call_queue`]: super::HostConfig::call_queue
//! [`HostConfig::max_request_deadline_ms`]: super::HostConfig::max_request_deadline_ms
//! [`FailureKind::Capacity`]: super::FailureKind::Capacity

use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::error::PolicyError;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of threads taking calls from one bounded queue.
pub(crate) struct CallPool {
    tx: Option<SyncSender<Job>>,
    threads: Vec<JoinHandle<()>>,
    queue: usize,
}

/// The queue was full: the call was not run.
#[derive(Debug)]
pub(crate) struct Full {
    pub(crate) threads: usize,
    pub(crate) queue: usize,
}

impl CallPool {
    /// Starts `threads` (at least one) threads named `policy-call-<i>`.
    pub(crate) fn new(threads: usize, queue: usize) -> Result<CallPool, PolicyError> {
        let (tx, rx) = sync_channel::<Job>(queue);
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx = Arc::clone(&rx);
                std::thread::Builder::new()
                    .name(format!("policy-call-{i}"))
                    .spawn(move || work(&rx))
                    .map_err(|e| PolicyError::Engine(format!("policy call thread: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CallPool {
            tx: Some(tx),
            threads,
            queue,
        })
    }

    /// Queues `f`; its result comes through the returned [`PolicyCall`].
    /// `Err` without running `f` when the queue is full.
    pub(crate) fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, PolicyError> + Send + 'static,
    ) -> Result<PolicyCall<T>, Full> {
        let (done, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            // The requester may have gone (client disconnected): nothing to do.
            let _ = done.send(f());
        });
        let full = || Full {
            threads: self.threads.len(),
            queue: self.queue,
        };
        match self.tx.as_ref().map(|tx| tx.try_send(job)) {
            Some(Ok(())) => Ok(PolicyCall(State::Waiting(rx))),
            Some(Err(TrySendError::Full(_) | TrySendError::Disconnected(_))) | None => Err(full()),
        }
    }
}

fn work(rx: &Mutex<Receiver<Job>>) {
    loop {
        // The lock is held only while waiting for the next job, never while
        // running one, so the other threads keep taking jobs.
        let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
        match job {
            Ok(job) => job(),
            Err(_) => return, // the pool was dropped
        }
    }
}

impl Drop for CallPool {
    fn drop(&mut self) {
        // Closing the queue ends each thread after its current job.
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The result of a policy call on the request path: ready at once (nothing
/// bound, a reused decision, a full queue) or computed on a call thread.
/// `Send + 'static`: it borrows nothing from the request.
pub struct PolicyCall<T>(State<T>);

enum State<T> {
    Ready(Option<Result<T, PolicyError>>),
    Waiting(oneshot::Receiver<Result<T, PolicyError>>),
}

impl<T> PolicyCall<T> {
    pub(crate) fn ready(result: Result<T, PolicyError>) -> Self {
        PolicyCall(State::Ready(Some(result)))
    }
}

// Nothing is pinned: the result is moved out, and the receiver is `Unpin`.
impl<T> Unpin for PolicyCall<T> {}

impl<T> Future for PolicyCall<T> {
    type Output = Result<T, PolicyError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().0 {
            State::Ready(r) => Poll::Ready(r.take().unwrap_or_else(|| {
                Err(PolicyError::Engine(
                    "policy call polled after it finished".into(),
                ))
            })),
            State::Waiting(rx) => Pin::new(rx).poll(cx).map(|r| {
                r.unwrap_or_else(|_| {
                    Err(PolicyError::Engine(
                        "policy call thread dropped the call (it panicked)".into(),
                    ))
                })
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn a_full_queue_refuses_at_once_and_calls_run_off_the_caller() {
        let pool = CallPool::new(1, 1).unwrap();
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let started = Arc::new(AtomicUsize::new(0));
        let block = |gate: Arc<Mutex<Receiver<()>>>, started: Arc<AtomicUsize>| {
            move || {
                started.fetch_add(1, Ordering::SeqCst);
                let _ = gate.lock().unwrap().recv();
                Ok(std::thread::current().name().map(str::to_owned))
            }
        };
        let first = pool
            .submit(block(gate.clone(), started.clone()))
            .ok()
            .unwrap();
        // Wait until the one thread runs the first call; then one fits the
        // queue and the next is refused.
        while started.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let second = pool
            .submit(block(gate.clone(), started.clone()))
            .ok()
            .unwrap();
        let full = pool.submit(|| Ok(None::<String>)).err().unwrap();
        assert_eq!((full.threads, full.queue), (1, 1));
        release.send(()).unwrap();
        release.send(()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let name = rt.block_on(first).unwrap();
        assert_eq!(name.as_deref(), Some("policy-call-0"));
        assert!(rt.block_on(second).is_ok());
    }
}
