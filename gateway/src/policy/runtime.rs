//! One loaded policy version: its `InstancePre`, a small pool of warm
//! instances checked out per call, and the trap classification.
//!
//! Guarantees: every call runs under the policy's deadline, fuel and memory
//! cap; an instance that trapped is dropped (wasmtime refuses to re-enter it)
//! and the next call gets a fresh one from the same `InstancePre`; warm
//! instances are retired after `max_calls_per_instance` calls or once their
//! memory grew past half the cap.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use wasmtime::component::{Component, InstancePre, Linker};
use wasmtime::{
    Engine, PoolConcurrencyLimitError, ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder,
    Trap, UpdateDeadline,
};

use super::bindings::{Latencies, adapter, dataset, router};
use super::engine::Watchdog;
use super::error::{FailureKind, PolicyError};
use super::metrics::Counters;
use super::reuse::DecisionTable;
use super::types::{Limits, PolicyInfo, PolicyKind};

/// Wall-clock budget for a fresh instance's `init`.
const INIT_DEADLINE: Duration = Duration::from_secs(1);

/// Store data: the resource limiter, the running call's deadline, and what
/// a router may ask while it runs. Guests get no other capabilities.
pub(crate) struct HostState {
    limiter: CapLimiter,
    /// When the call now running must stop; checked each time the
    /// [`Watchdog`] advances the epoch.
    deadline: Instant,
    /// The running router call's backends and their latency, for
    /// `backend-stats.latency-ms`.
    pub(crate) latencies: Latencies,
    /// The priority class the running router call set
    /// (`request-control.set-priority`; 0 unless it did).
    pub(crate) priority: i8,
    /// The running router call's caller quota (`caller-quota.remaining`).
    pub(crate) quota: super::types::Quota,
}

impl router::mlxgate::policy::caller_quota::Host for HostState {
    fn remaining(&mut self) -> router::mlxgate::policy::caller_quota::Quota {
        router::mlxgate::policy::caller_quota::Quota {
            requests_per_minute: self.quota.requests_per_minute,
            tokens_per_minute: self.quota.tokens_per_minute,
            daily_tokens: self.quota.daily_tokens,
        }
    }
}

impl router::mlxgate::policy::request_control::Host for HostState {
    fn set_priority(&mut self, class: i8) {
        self.priority = class;
    }
}

impl router::mlxgate::policy::backend_stats::Host for HostState {
    fn latency_ms(&mut self, name: String) -> Option<f32> {
        self.latencies
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, ms)| *ms)
    }
}

/// `StoreLimits` (memory cap, trap on grow failure) plus a note that the cap
/// was hit, so a trap that follows is reported as a memory-limit failure, and
/// the largest memory size granted (the instance's high-water mark).
struct CapLimiter {
    inner: StoreLimits,
    cap: usize,
    hit: bool,
    peak: usize,
}

impl ResourceLimiter for CapLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.cap || maximum.is_some_and(|m| desired > m) {
            self.hit = true;
        }
        let granted = self.inner.memory_growing(current, desired, maximum)?;
        if granted {
            self.peak = self.peak.max(desired);
        }
        Ok(granted)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.hit = true;
        self.inner.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.inner.instances()
    }

    fn tables(&self) -> usize {
        self.inner.tables()
    }

    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

/// The typed `InstancePre` of a policy, by kind.
pub(crate) enum Pre {
    Router(router::RouterPolicyPre<HostState>),
    Adapter(adapter::AdapterSelectorPolicyPre<HostState>),
    Dataset(dataset::DatasetTransformPolicyPre<HostState>),
}

/// A live instance's typed exports, by kind.
pub(crate) enum Bound {
    Router(router::RouterPolicy),
    Adapter(adapter::AdapterSelectorPolicy),
    Dataset(dataset::DatasetTransformPolicy),
}

struct Warm {
    store: Store<HostState>,
    bound: Bound,
    calls: u64,
}

/// CPU budget of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    pub(crate) time: Duration,
    pub(crate) fuel: u64,
}

impl Budget {
    /// `units` deadlines/fuel budgets of `limits` (1 for request-time calls,
    /// the record count for dataset batches).
    pub(crate) fn of(limits: &Limits, units: u64) -> Budget {
        let units = units.max(1);
        Budget {
            time: Duration::from_millis(u64::from(limits.deadline_ms).saturating_mul(units)),
            fuel: limits.fuel.map_or(u64::MAX, |f| f.saturating_mul(units)),
        }
    }
}

/// A failed call: what kind, and wasmtime's words.
pub(crate) type Failure = (FailureKind, String);

/// One uploaded version of a policy, ready to call.
pub(crate) struct LoadedPolicy {
    pub(crate) info: PolicyInfo,
    pub(crate) counters: Arc<Counters>,
    pub(crate) watchdog: Arc<Watchdog>,
    /// Reusable decisions, for a router that declared its decision inputs.
    pub(crate) decisions: Option<DecisionTable>,
    engine: Engine,
    pre: Pre,
    pool: Mutex<Vec<Warm>>,
    max_calls_per_instance: u64,
}

impl LoadedPolicy {
    /// Links `component` (the one host import is `backend-stats`, a
    /// read-only query) and type-checks its export
    /// against the world of `info.kind`.
    pub(crate) fn new(
        engine: &Engine,
        linker: &Linker<HostState>,
        component: &Component,
        info: PolicyInfo,
        counters: Arc<Counters>,
        watchdog: Arc<Watchdog>,
        max_calls_per_instance: u64,
    ) -> Result<Self, PolicyError> {
        let instance_pre: InstancePre<HostState> = linker
            .instantiate_pre(component)
            .map_err(|e| PolicyError::UnsatisfiedImports(format!("{e:#}")))?;
        let mismatch = |e: wasmtime::Error| PolicyError::InterfaceMismatch(format!("{e:#}"));
        let pre = match info.kind {
            PolicyKind::Router => {
                Pre::Router(router::RouterPolicyPre::new(instance_pre).map_err(mismatch)?)
            }
            PolicyKind::AdapterSelector => Pre::Adapter(
                adapter::AdapterSelectorPolicyPre::new(instance_pre).map_err(mismatch)?,
            ),
            PolicyKind::DatasetTransform => Pre::Dataset(
                dataset::DatasetTransformPolicyPre::new(instance_pre).map_err(mismatch)?,
            ),
        };
        Ok(LoadedPolicy {
            decisions: info.decision_inputs.as_deref().and_then(DecisionTable::new),
            info,
            counters,
            watchdog,
            engine: engine.clone(),
            pre,
            pool: Mutex::new(Vec::new()),
            max_calls_per_instance,
        })
    }

    /// Runs `f` on a warm (or fresh) instance under `budget`. The instance
    /// goes back to the pool on success and is dropped on failure.
    pub(crate) fn call<R>(
        &self,
        budget: Budget,
        f: impl FnOnce(&mut Store<HostState>, &Bound) -> wasmtime::Result<R>,
    ) -> Result<R, Failure> {
        let mut warm = match self.checkout() {
            Some(w) => w,
            None => self.fresh()?,
        };
        let deadline = far_off(budget.time);
        let _running = self.watchdog.enter(deadline);
        warm.store.data_mut().deadline = deadline;
        warm.store.set_epoch_deadline(1);
        warm.store
            .set_fuel(budget.fuel)
            .map_err(|e| (FailureKind::Trap, format!("{e:#}")))?;
        match f(&mut warm.store, &warm.bound) {
            Ok(r) => {
                warm.calls += 1;
                self.checkin(warm);
                Ok(r)
            }
            Err(e) => Err(classify(&warm.store, &e)),
        }
    }

    /// Number of warm instances currently pooled (for tests and status).
    pub(crate) fn warm_count(&self) -> usize {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    fn checkout(&self) -> Option<Warm> {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    /// Pools an instance that answered, unless it is due for retirement: too
    /// many calls, or linear memory grown past half the cap (memory never
    /// shrinks, so a grown instance would keep its pool slot's pages).
    fn checkin(&self, warm: Warm) {
        self.counters.memory_seen(warm.store.data().limiter.peak);
        if warm.calls >= self.max_calls_per_instance
            || warm.store.data().limiter.peak > self.info.limits.memory_bytes / 2
        {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < self.info.limits.warm_instances as usize {
            pool.push(warm);
        }
    }

    /// Instantiates and runs the guest's `init(config)`.
    fn fresh(&self) -> Result<Warm, Failure> {
        let limits = &self.info.limits;
        let state = HostState {
            limiter: CapLimiter {
                inner: StoreLimitsBuilder::new()
                    .memory_size(limits.memory_bytes)
                    // Room for an interpreter linked from many core modules
                    // (Python and JavaScript guests); the pool's per-component
                    // caps in engine.rs match.
                    .instances(64)
                    .tables(32)
                    .memories(4)
                    .trap_on_grow_failure(true)
                    .build(),
                cap: limits.memory_bytes,
                hit: false,
                peak: 0,
            },
            deadline: far_off(INIT_DEADLINE),
            latencies: Latencies::default(),
            quota: Default::default(),
            priority: 0,
        };
        let _running = self.watchdog.enter(state.deadline);
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_callback(|cx| {
            Ok(if Instant::now() >= cx.data().deadline {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::Continue(1)
            })
        });
        store.set_epoch_deadline(1);
        store
            .set_fuel(u64::MAX)
            .map_err(|e| (FailureKind::Trap, format!("{e:#}")))?;
        let bound = match &self.pre {
            Pre::Router(p) => p.instantiate(&mut store).map(Bound::Router),
            Pre::Adapter(p) => p.instantiate(&mut store).map(Bound::Adapter),
            Pre::Dataset(p) => p.instantiate(&mut store).map(Bound::Dataset),
        }
        .map_err(|e| classify(&store, &e))?;
        self.counters.instance_created();
        let config = self.info.config.as_deref().unwrap_or("");
        let init = match &bound {
            Bound::Router(b) => b.mlxgate_policy_router().call_init(&mut store, config),
            Bound::Adapter(b) => b
                .mlxgate_policy_adapter_selector()
                .call_init(&mut store, config),
            Bound::Dataset(b) => b
                .mlxgate_policy_dataset_transform()
                .call_init(&mut store, config),
        };
        match init {
            Ok(Ok(())) => Ok(Warm {
                store,
                bound,
                calls: 0,
            }),
            Ok(Err(msg)) => Err((FailureKind::InitFailed, truncate(msg, 1024))),
            Err(e) => Err(classify(&store, &e)),
        }
    }
}

/// `budget` from now (a year when that overflows an `Instant`).
fn far_off(budget: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(budget)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 86_400))
}

/// Maps a wasmtime error to a failure kind; memory-cap hits win because the
/// guest allocator usually turns them into an `unreachable` trap.
fn classify(store: &Store<HostState>, err: &wasmtime::Error) -> Failure {
    // A trap's own message is enough for callers; other errors keep context.
    let detail = match err.downcast_ref::<Trap>() {
        Some(trap) => trap.to_string(),
        None => truncate(format!("{err:#}"), 1024),
    };
    if store.data().limiter.hit {
        return (FailureKind::MemoryLimit, detail);
    }
    let kind = match err.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => FailureKind::Timeout,
        Some(Trap::OutOfFuel) => FailureKind::OutOfFuel,
        Some(Trap::StackOverflow) => FailureKind::StackOverflow,
        Some(Trap::UnreachableCodeReached) => FailureKind::Panic,
        Some(_) => FailureKind::Trap,
        None if err.downcast_ref::<PoolConcurrencyLimitError>().is_some() => FailureKind::Capacity,
        None => FailureKind::Trap,
    };
    (kind, detail)
}

/// Cuts a guest-supplied or error string to at most `max` bytes.
pub(crate) fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}
