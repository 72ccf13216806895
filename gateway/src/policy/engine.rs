//! The one wasmtime `Engine` for all policies, and its epoch ticker.
//!
//! Configuration: pooling allocator (slots sized by [`HostConfig`], each linear
//! memory reserving only `max_memory_bytes` plus a 64 KiB guard, so explicit
//! bounds checks replace the 4 GiB guard regions), epoch interruption driven by
//! a ticker thread that runs while policies are being called (wall-clock
//! deadlines for request-time policies), fuel
//! (deterministic budgets for dataset transforms; other kinds get an unlimited
//! budget unless configured) and a bounded Wasm stack.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

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
    /// Ceiling for any policy's deadline.
    pub max_deadline_ms: u32,
    /// Epoch tick period.
    pub tick: Duration,
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
            max_component_bytes: 16 << 20,
            max_deadline_ms: 60_000,
            tick: Duration::from_millis(1),
            max_calls_per_instance: 10_000,
        }
    }
}

/// Ticks without any call after which the epoch ticker parks.
const IDLE_TICKS: u32 = 100;

/// The engine plus the thread that advances its epoch; the thread stops when
/// this is dropped.
pub(crate) struct PolicyEngine {
    pub(crate) engine: Engine,
    /// Stable key of `Engine::precompile_compatibility_hash`, hex.
    pub(crate) compat_key: String,
    pub(crate) clock: Arc<EpochClock>,
    ticker: Option<JoinHandle<()>>,
}

/// The epoch's tick period and the ticker's state. Deadlines only need the
/// epoch to advance while a guest runs, so the ticker parks after
/// [`IDLE_TICKS`] ticks in which no call began, and the next call wakes it:
/// a gateway whose policies are not being called has no 1 kHz wake-ups.
pub(crate) struct EpochClock {
    pub(crate) tick: Duration,
    /// A call began since the ticker last looked.
    called: AtomicBool,
    /// Calls inside a guest now: the ticker never parks while one runs, or a
    /// deadline longer than its idle spell would never come.
    running: AtomicUsize,
    /// The ticker is parked (or about to park): the next call unparks it.
    parked: AtomicBool,
    stop: AtomicBool,
    thread: OnceLock<Thread>,
}

/// A call inside a guest, from [`EpochClock::enter`] until dropped.
pub(crate) struct RunningCall<'a>(&'a EpochClock);

impl Drop for RunningCall<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EpochClock {
    /// Called before entering a guest, held until the guest returns: the
    /// epoch keeps advancing for as long as the call runs.
    pub(crate) fn enter(&self) -> RunningCall<'_> {
        self.running.fetch_add(1, Ordering::SeqCst);
        self.wake();
        RunningCall(self)
    }

    /// Makes sure the epoch advances (unparks the ticker).
    fn wake(&self) {
        // SeqCst pairs with the ticker's store of `parked` then load of
        // `called`: either it sees this call, or this sees it parked.
        if !self.called.load(Ordering::Relaxed) {
            self.called.store(true, Ordering::SeqCst);
        }
        if self.parked.load(Ordering::SeqCst)
            && self.parked.swap(false, Ordering::SeqCst)
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
    }

    fn run(&self, engine: &Engine) {
        let mut idle = 0;
        while !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(self.tick);
            engine.increment_epoch();
            let began = self.called.swap(false, Ordering::SeqCst);
            if began || self.running.load(Ordering::SeqCst) > 0 {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < IDLE_TICKS {
                continue;
            }
            self.parked.store(true, Ordering::SeqCst);
            if !self.called.load(Ordering::SeqCst)
                && self.running.load(Ordering::SeqCst) == 0
                && !self.stop.load(Ordering::SeqCst)
            {
                // A spurious wake-up only costs one more idle period.
                std::thread::park();
            }
            self.parked.store(false, Ordering::SeqCst);
            idle = 0;
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

        let clock = Arc::new(EpochClock {
            tick: cfg.tick,
            called: AtomicBool::new(false),
            running: AtomicUsize::new(0),
            parked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
        });
        let ticker = {
            let engine = engine.clone();
            let clock = Arc::clone(&clock);
            std::thread::Builder::new()
                .name("policy-epoch".into())
                .spawn(move || clock.run(&engine))
                .map_err(|e| PolicyError::Engine(format!("epoch ticker: {e}")))?
        };
        let _ = clock.thread.set(ticker.thread().clone());
        Ok(PolicyEngine {
            engine,
            compat_key,
            clock,
            ticker: Some(ticker),
        })
    }
}

impl Drop for PolicyEngine {
    fn drop(&mut self) {
        self.clock.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.ticker.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn parked_within(clock: &EpochClock, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if clock.parked.load(Ordering::SeqCst) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    #[test]
    fn the_ticker_parks_when_idle_and_calls_wake_it() {
        let dir = tempfile::tempdir().unwrap();
        let e = PolicyEngine::new(&HostConfig::new(dir.path())).unwrap();
        assert!(parked_within(&e.clock, Duration::from_secs(5)));
        e.clock.wake();
        assert!(!e.clock.parked.load(Ordering::SeqCst));
        // Calls keep it awake; it parks again once they stop.
        for _ in 0..20 {
            e.clock.wake();
            std::thread::sleep(Duration::from_millis(10));
            assert!(!e.clock.parked.load(Ordering::SeqCst));
        }
        assert!(parked_within(&e.clock, Duration::from_secs(5)));
    }
}
