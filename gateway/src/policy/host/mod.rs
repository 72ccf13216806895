//! [`PolicyHost`]: upload, validate, store, bind and call policies.
//!
//! Concurrency: management operations are serialised by one mutex; the set of
//! loaded policies and bindings is an immutable snapshot behind an
//! `RwLock<Arc<_>>`, replaced whole on each change. A call clones the `Arc` of
//! its policy version and runs without any lock held, so a swap never blocks
//! calls and in-flight calls finish on the version they started with.
//! Request-time calls (`route_if_bound`, `select_if_bound`) run on the
//! host's own few call threads (`policy/pool.rs`), never the caller's.
//!
//! This module holds the host itself, its snapshot and opening a data dir;
//! the operations sit in submodules, each adding to `impl PolicyHost`:
//!
//! * `admin`: what operators do (upload, list, get, remove, bind, unbind,
//!   metrics) and reloading stored policies;
//! * `validation`: the checks an upload passes (name, Wasm header, exported
//!   interface, one probe call);
//! * `calls`: calling policies (route, select adapters, transform records)
//!   and checking what the guest answered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use wasmtime::component::Linker;

use super::engine::{HostConfig, PolicyEngine};
use super::error::PolicyError;
use super::metrics::Counters;
use super::pool::CallPool;
use super::runtime::{HostState, LoadedPolicy};
use super::storage::{Bindings, Storage};
use super::types::{PolicyInfo, PolicyKind};

mod admin;
mod calls;
mod validation;

pub use validation::probe_facts;

#[derive(Default)]
struct Snapshot {
    policies: HashMap<String, Arc<LoadedPolicy>>,
    bindings: Bindings,
}

impl Snapshot {
    /// The stored policy `name`, which must be of `kind`.
    fn of_kind(&self, name: &str, kind: PolicyKind) -> Result<&Arc<LoadedPolicy>, PolicyError> {
        let p = self
            .policies
            .get(name)
            .ok_or_else(|| PolicyError::NotFound(name.to_string()))?;
        if p.info.kind != kind {
            return Err(PolicyError::KindMismatch {
                name: name.to_string(),
                wanted: kind,
                actual: p.info.kind,
            });
        }
        Ok(p)
    }

    /// The policy bound for `kind`, borrowed: a call holds the snapshot, so
    /// a swap during it leaves this version alive until the call ends.
    fn bound(&self, kind: PolicyKind) -> Result<&LoadedPolicy, PolicyError> {
        self.bound_arc(kind).map(Arc::as_ref)
    }

    /// The policy bound for `kind`, shared, for a call on another thread.
    fn bound_arc(&self, kind: PolicyKind) -> Result<&Arc<LoadedPolicy>, PolicyError> {
        self.bindings
            .get(kind)
            .and_then(|n| self.policies.get(n))
            .ok_or(PolicyError::NotBound(kind))
    }
}

/// The policy platform of one gateway process. Knows nothing of HTTP.
pub struct PolicyHost {
    /// Threads for request-time calls (`route_if_bound`, `select_if_bound`).
    /// First, so it is dropped first: its threads finish their calls while
    /// the engine's watchdog still interrupts guests past their deadline.
    calls: CallPool,
    cfg: HostConfig,
    engine: PolicyEngine,
    linker: Linker<HostState>,
    storage: Storage,
    snapshot: RwLock<Arc<Snapshot>>,
    /// Metrics per policy name, surviving swaps.
    counters: Mutex<HashMap<String, Arc<Counters>>>,
    admin: Mutex<()>,
    load_errors: Vec<String>,
}

impl PolicyHost {
    /// Opens (creating if needed) the policy store under `cfg.data_dir` and
    /// loads every stored policy and binding, reusing precompiled artifacts.
    /// A policy that fails to load is skipped and reported by
    /// [`PolicyHost::load_errors`]; bindings to it are dropped.
    pub fn open(cfg: HostConfig) -> Result<Self, PolicyError> {
        let engine = PolicyEngine::new(&cfg)?;
        let mut linker = Linker::new(&engine.engine);
        // The host functions a guest may import: routers' backend-stats
        // (since 0.3.1), request-control (since 0.3.2) and caller-quota
        // (since 0.3.3).
        crate::policy::bindings::router::mlxgate::policy::backend_stats::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |state| state)
        .map_err(|e| PolicyError::Engine(format!("cannot link backend-stats: {e}")))?;
        crate::policy::bindings::router::mlxgate::policy::request_control::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |state| state)
        .map_err(|e| PolicyError::Engine(format!("cannot link request-control: {e}")))?;
        crate::policy::bindings::router::mlxgate::policy::caller_quota::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |state| state)
        .map_err(|e| PolicyError::Engine(format!("cannot link caller-quota: {e}")))?;
        let storage = Storage::open(&cfg.data_dir)?;
        let calls = CallPool::new(cfg.call_threads, cfg.call_queue)?;
        let mut host = PolicyHost {
            cfg,
            engine,
            linker,
            storage,
            snapshot: RwLock::new(Arc::new(Snapshot::default())),
            counters: Mutex::new(HashMap::new()),
            admin: Mutex::new(()),
            load_errors: Vec::new(),
            calls,
        };
        let mut snap = Snapshot::default();
        for meta in host.storage.load_metas() {
            match meta.and_then(|m| host.reload(m)) {
                Ok(p) => {
                    snap.policies.insert(p.info.name.clone(), Arc::new(p));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "policy not loaded");
                    host.load_errors.push(e.to_string());
                }
            }
        }
        let mut bindings = host.storage.load_bindings();
        for kind in [PolicyKind::Router, PolicyKind::AdapterSelector] {
            let ok = bindings
                .get(kind)
                .is_none_or(|n| snap.policies.get(n).is_some_and(|p| p.info.kind == kind));
            if !ok {
                host.load_errors
                    .push(format!("{kind} binding dropped: policy not loaded"));
                bindings.set(kind, None);
            }
        }
        snap.bindings = bindings;
        host.snapshot = RwLock::new(Arc::new(snap));
        Ok(host)
    }

    /// Problems met while loading the data dir at [`PolicyHost::open`].
    pub fn load_errors(&self) -> &[String] {
        &self.load_errors
    }

    /// The host-wide configuration.
    pub fn config(&self) -> &HostConfig {
        &self.cfg
    }

    fn snap(&self) -> Arc<Snapshot> {
        self.snapshot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn publish(&self, snap: Snapshot) {
        *self
            .snapshot
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(snap);
    }

    fn clone_snap(&self) -> Snapshot {
        let cur = self.snap();
        Snapshot {
            policies: cur.policies.clone(),
            bindings: cur.bindings.clone(),
        }
    }

    fn counters_for(&self, name: &str) -> Arc<Counters> {
        self.counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    fn info_of(p: &LoadedPolicy, bindings: &Bindings) -> PolicyInfo {
        let mut info = p.info.clone();
        info.bound_as = bindings.kinds_of(&info.name);
        info
    }
}

impl std::fmt::Debug for PolicyHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyHost")
            .field("data_dir", &self.cfg.data_dir)
            .field("policies", &self.snap().policies.len())
            .finish()
    }
}

// The host is shared across request workers.
const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<PolicyHost>();
};
