//! The one wasmtime `Engine` for all policies, and its epoch ticker.
//!
//! Configuration: pooling allocator (slots sized by [`HostConfig`], each linear
//! memory reserving only `max_memory_bytes` plus a 64 KiB guard, so explicit
//! bounds checks replace the 4 GiB guard regions), epoch interruption driven by
//! a ticker thread (wall-clock deadlines for request-time policies), fuel
//! (deterministic budgets for dataset transforms; other kinds get an unlimited
//! budget unless configured) and a bounded Wasm stack.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
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

/// The engine plus the thread that advances its epoch; the thread stops when
/// this is dropped.
pub(crate) struct PolicyEngine {
    pub(crate) engine: Engine,
    /// Stable key of `Engine::precompile_compatibility_hash`, hex.
    pub(crate) compat_key: String,
    stop: Arc<AtomicBool>,
    ticker: Option<JoinHandle<()>>,
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

        let stop = Arc::new(AtomicBool::new(false));
        let ticker = {
            let engine = engine.clone();
            let stop = stop.clone();
            let tick = cfg.tick;
            std::thread::Builder::new()
                .name("policy-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(tick);
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| PolicyError::Engine(format!("epoch ticker: {e}")))?
        };
        Ok(PolicyEngine {
            engine,
            compat_key,
            stop,
            ticker: Some(ticker),
        })
    }
}

impl Drop for PolicyEngine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}
