//! Serving threads: each accepted connection is handed to one of a fixed
//! set of threads, each running a single-threaded runtime, and stays there
//! for its whole life, as nginx's worker processes keep theirs. Its
//! requests, the upstream connections they reuse (pooled per thread, see
//! `util::threads`) and every wake-up of either never cross threads.
//!
//! Why not the work-stealing runtime: under proxy load its workers wake,
//! steal and hand tasks between cores, and the same requests cost ~29% more
//! CPU than on one worker (25.2 against 19.6 us; BENCHMARKS.md, "Serving
//! threads"). The shared runtime still runs what is not a connection:
//! model loading, jobs, the policy host's opening, health checks.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The serving threads; dropping this stops them, dropping what they still
/// serve (`run` drops it after the shutdown grace period).
pub struct ServingThreads {
    /// Each thread's runtime, and what keeps it running.
    threads: Vec<(Handle, oneshot::Sender<()>)>,
    next: AtomicUsize,
}

impl ServingThreads {
    /// Starts `n` threads (at least one).
    pub fn start(n: usize) -> io::Result<ServingThreads> {
        let mut threads = Vec::with_capacity(n.max(1));
        for index in 0..n.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (stop, stopped) = oneshot::channel::<()>();
            threads.push((rt.handle().clone(), stop));
            std::thread::Builder::new()
                .name(format!("serve-{index}"))
                .spawn(move || {
                    crate::util::threads::set_serving_index(index);
                    // Runs the tasks spawned on it until the sender drops.
                    let _ = rt.block_on(stopped);
                    // Blocking tasks still running are not waited for.
                    rt.shutdown_background();
                })?;
        }
        Ok(ServingThreads {
            threads,
            next: AtomicUsize::new(0),
        })
    }

    /// Spawns `connection` on the next thread in turn, where it runs to its
    /// end: a socket it makes registers with that thread's reactor.
    pub fn spawn(&self, connection: impl Future<Output = ()> + Send + 'static) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        drop(self.threads[i].0.spawn(connection));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{RecvTimeoutError, channel};
    use std::time::Duration;

    use super::*;
    use crate::util::threads::slot;

    const WAIT: Duration = Duration::from_secs(10);

    #[test]
    fn connections_go_to_each_thread_in_turn_and_stay_there() {
        let threads = ServingThreads::start(2).unwrap();
        let (tx, rx) = channel();
        for _ in 0..4 {
            let tx = tx.clone();
            threads.spawn(async move {
                let before = (std::thread::current().name().map(str::to_owned), slot());
                // Across an await, still the same thread.
                tokio::task::yield_now().await;
                let after = (std::thread::current().name().map(str::to_owned), slot());
                tx.send((before, after)).unwrap();
            });
        }
        let mut seen: Vec<_> = (0..4).map(|_| rx.recv_timeout(WAIT).unwrap()).collect();
        seen.sort();
        let on = |name: &str, slot| ((Some(name.to_owned()), slot), (Some(name.to_owned()), slot));
        assert_eq!(
            seen,
            [
                on("serve-0", 1),
                on("serve-0", 1),
                on("serve-1", 2),
                on("serve-1", 2)
            ]
        );
    }

    #[test]
    fn dropping_them_drops_what_they_still_serve() {
        let threads = ServingThreads::start(1).unwrap();
        let (tx, rx) = channel::<()>();
        threads.spawn(async move {
            let _held = tx;
            std::future::pending::<()>().await;
        });
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(200)),
            Err(RecvTimeoutError::Timeout)
        );
        drop(threads);
        assert_eq!(rx.recv_timeout(WAIT), Err(RecvTimeoutError::Disconnected));
    }
}
