//! The one wasmtime `Engine` for all policies, and the watchdog that
//! interrupts guests past their deadline.
//!
//! Configuration: pooling allocator (slots sized by [`HostConfig`], each linear
//! memory reserving only `max_memory_bytes` plus a 64 KiB guard, so explicit
//! bounds checks replace the 4 GiB guard regions), epoch interruption driven by
//! the [`Watchdog`] (wall-clock deadlines for request-time policies), fuel
//! (deterministic budgets for dataset transforms; other kinds get an unlimited
//! budget unless configured) and a bounded Wasm stack.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::error::PolicyError;

/// Host-wide settings: ceilings that per-policy limits must stay under, and
/// the sizes of the instance pool.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Where metadata, component bytes and compiled artifacts live.
    pub data_dir: PathBuf,
    /// Concurrent instances across all policies (warm ones included).
    pub max_instances: u32,
    /// Ceiling for any policy's memory cap; also the pool's slot size.
    pub max_memory_bytes: usize,
    /// Wasm stack size for every guest (engine-wide in wasmtime).
    pub max_wasm_stack: usize,
    /// Largest accepted component.
    pub max_component_bytes: usize,
    /// Ceiling for any policy's deadline (dataset transforms, which run in
    /// jobs, per record).
    pub max_deadline_ms: u32,
    /// Ceiling for the deadline of request-time policies (routers, adapter
    /// selectors): every request waits for their call, so a long deadline
    /// is a long stall per request. Uploads over it get 400
    /// `invalid_limits`; a stored one over it (an older gateway allowed
    /// 60 s) is lowered to it on load.
    pub max_request_deadline_ms: u32,
    /// Threads running request-time guest calls (see `policy/pool.rs`):
    /// the most calls that run at once; guests never run on async workers.
    pub call_threads: usize,
    /// Request-time calls that may wait for a call thread; one more fails
    /// at once as a `capacity` failure (the policy's `on_error` applies).
    pub call_queue: usize,
    /// Longest the watchdog waits, while calls run, before advancing the
    /// epoch again: a call whose deadline it did not schedule (an earlier
    /// one came first) is stopped at most this long after its deadline.
    pub recheck: Duration,
    /// A warm instance is replaced after this many calls, bounding state a
    /// guest can accumulate across requests.
    pub max_calls_per_instance: u64,
}

impl HostConfig {
    /// Defaults suitable for a gateway process, storing under `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        HostConfig {
            data_dir: data_dir.into(),
            max_instances: 256,
            max_memory_bytes: 128 << 20,
            max_wasm_stack: 512 << 10,
            max_component_bytes: 64 << 20,
            max_deadline_ms: 60_000,
            max_request_deadline_ms: 1_000,
            call_threads: 2,
            call_queue: 64,
            recheck: Duration::from_millis(10),
            max_calls_per_instance: 10_000,
        }
    }
}

/// The engine plus the watchdog thread; the thread stops when this is
/// dropped.
pub(crate) struct PolicyEngine {
    pub(crate) engine: Engine,
    /// Stable key of `Engine::precompile_compatibility_hash`, hex.
    pub(crate) compat_key: String,
    pub(crate) watchdog: Arc<Watchdog>,
    thread: Option<JoinHandle<()>>,
}

/// No deadline (as nanoseconds after [`Watchdog::base`]).
const NONE: u64 = u64::MAX;

/// Interrupts guest calls that run past their deadline, waking only when a
/// deadline comes rather than on a fixed tick.
///
/// Every call registers its deadline on entry ([`Watchdog::enter`]); the
/// thread sleeps until the earliest registered one and then advances the
/// engine's epoch. Each store's epoch deadline is one tick ahead, so every
/// guest running at that moment stops in its epoch callback, which traps it
/// if its own deadline has passed and lets it go on otherwise. Only the
/// earliest deadline registered between two wake-ups is kept, so while
/// calls run the thread also wakes every [`HostConfig::recheck`]. Under
/// steady traffic it wakes every few milliseconds, not once per call or
/// per millisecond; with no call running it parks until the next one.
pub(crate) struct Watchdog {
    base: Instant,
    /// Earliest deadline registered since the thread last looked.
    next: AtomicU64,
    /// What the thread sleeps until ([`NONE`]: parked until a call comes).
    sleeping_until: AtomicU64,
    /// Calls inside a guest now.
    running: AtomicUsize,
    recheck: Duration,
    /// Times the epoch was advanced (tests and diagnostics).
    advanced: AtomicU64,
    stop: AtomicBool,
    thread: OnceLock<Thread>,
}

/// A call inside a guest, from [`Watchdog::enter`] until dropped.
pub(crate) struct RunningCall<'a>(&'a Watchdog);

impl Drop for RunningCall<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Watchdog {
    fn new(recheck: Duration) -> Watchdog {
        Watchdog {
            base: Instant::now(),
            next: AtomicU64::new(NONE),
            sleeping_until: AtomicU64::new(NONE),
            running: AtomicUsize::new(0),
            recheck,
            advanced: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
        }
    }

    /// Called before entering a guest that must stop by `deadline`; the
    /// returned guard is held until the guest returns.
    pub(crate) fn enter(&self, deadline: Instant) -> RunningCall<'_> {
        self.running.fetch_add(1, Ordering::SeqCst);
        let at = self.nanos(deadline);
        self.next.fetch_min(at, Ordering::SeqCst);
        // SeqCst pairs with the thread's store of `sleeping_until` then load
        // of `next`: either it sees this deadline, or this sees it sleeping
        // past it.
        if at < self.sleeping_until.load(Ordering::SeqCst)
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
        RunningCall(self)
    }

    fn nanos(&self, t: Instant) -> u64 {
        let n = t.saturating_duration_since(self.base).as_nanos();
        u64::try_from(n).unwrap_or(NONE - 1).min(NONE - 1)
    }

    fn run(&self, engine: &Engine) {
        let mut target = NONE;
        while !self.stop.load(Ordering::SeqCst) {
            target = target.min(self.next.swap(NONE, Ordering::SeqCst));
            if target == NONE {
                if self.running.load(Ordering::SeqCst) == 0 {
                    self.sleeping_until.store(NONE, Ordering::SeqCst);
                    if self.next.load(Ordering::SeqCst) == NONE
                        && self.running.load(Ordering::SeqCst) == 0
                        && !self.stop.load(Ordering::SeqCst)
                    {
                        std::thread::park();
                    }
                    continue;
                }
                // Calls run whose deadlines were not kept: check them soon.
                target = self.nanos(Instant::now() + self.recheck);
            }
            self.sleeping_until.store(target, Ordering::SeqCst);
            let now = self.nanos(Instant::now());
            if now < target {
                if self.next.load(Ordering::SeqCst) >= target {
                    std::thread::park_timeout(Duration::from_nanos(target - now));
                }
                // Woken early (an earlier deadline, stop) or on time: look again.
                continue;
            }
            target = NONE;
            if self.running.load(Ordering::SeqCst) > 0 {
                engine.increment_epoch();
                self.advanced.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl PolicyEngine {
    pub(crate) fn new(cfg: &HostConfig) -> Result<Self, PolicyError> {
        let n = cfg.max_instances.max(1);
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(n)
            .total_core_instances(n.saturating_mul(4))
            .total_memories(n.saturating_mul(2))
            .total_tables(n.saturating_mul(4))
            // Guests built from Python or JavaScript (componentize-py,
            // componentize-js) link an interpreter from many core modules.
            .max_core_instances_per_component(64)
            .max_memories_per_component(4)
            .max_tables_per_component(32)
            .max_memory_size(cfg.max_memory_bytes)
            // Return little memory to a slot's next user; keeps drop cheap.
            .linear_memory_keep_resident(64 << 10)
            .table_keep_resident(4 << 10);

        let mut config = Config::new();
        config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .consume_fuel(true)
            .max_wasm_stack(cfg.max_wasm_stack)
            .memory_reservation(cfg.max_memory_bytes as u64)
            .memory_guard_size(64 << 10)
            .memory_reservation_for_growth(0)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(|e| PolicyError::Engine(format!("{e:#}")))?;

        let mut hasher = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let compat_key = format!("{:016x}", hasher.finish());

        let watchdog = Arc::new(Watchdog::new(cfg.recheck));
        let thread = {
            let engine = engine.clone();
            let watchdog = Arc::clone(&watchdog);
            std::thread::Builder::new()
                .name("policy-watchdog".into())
                .spawn(move || watchdog.run(&engine))
                .map_err(|e| PolicyError::Engine(format!("policy watchdog: {e}")))?
        };
        let _ = watchdog.thread.set(thread.thread().clone());
        Ok(PolicyEngine {
            engine,
            compat_key,
            watchdog,
            thread: Some(thread),
        })
    }
}

impl Drop for PolicyEngine {
    fn drop(&mut self) {
        self.watchdog.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked_within(w: &Watchdog, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if w.sleeping_until.load(Ordering::SeqCst) == NONE {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    #[test]
    fn the_watchdog_parks_without_calls_and_wakes_once_per_deadline_under_load() {
        let dir = tempfile::tempdir().unwrap();
        let e = PolicyEngine::new(&HostConfig::new(dir.path())).unwrap();
        let w = &e.watchdog;
        assert!(parked_within(w, Duration::from_secs(5)));
        // 200 ms of back-to-back short calls with a 20 ms deadline: the epoch
        // advances every few ms (deadline or recheck), never per call.
        let start = Instant::now();
        let mut calls = 0;
        while start.elapsed() < Duration::from_millis(200) {
            let _call = w.enter(Instant::now() + Duration::from_millis(20));
            std::thread::sleep(Duration::from_micros(50));
            calls += 1;
        }
        let advanced = w.advanced.load(Ordering::Relaxed);
        assert!(calls > 100, "{calls}");
        assert!(
            advanced <= 50,
            "{advanced} epoch advances for {calls} calls"
        );
        assert!(parked_within(w, Duration::from_secs(5)));
    }

    #[test]
    fn a_call_past_its_deadline_gets_the_epoch_advanced_near_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let e = PolicyEngine::new(&HostConfig::new(dir.path())).unwrap();
        let w = &e.watchdog;
        assert!(parked_within(w, Duration::from_secs(5)));
        let start = Instant::now();
        let _call = w.enter(start + Duration::from_millis(30));
        while w.advanced.load(Ordering::Relaxed) == 0 {
            assert!(start.elapsed() < Duration::from_secs(5), "never advanced");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(start.elapsed() >= Duration::from_millis(30));
        // While it keeps running, the watchdog keeps checking it.
        let first = w.advanced.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        assert!(w.advanced.load(Ordering::Relaxed) > first);
    }
}
