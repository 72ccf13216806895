//! [`PolicyHost`]: upload, validate, store, bind and call policies.
//!
//! Concurrency: management operations are serialised by one mutex; the set of
//! loaded policies and bindings is an immutable snapshot behind an
//! `RwLock<Arc<_>>`, replaced whole on each change. A call clones the `Arc` of
//! its policy version and runs without any lock held, so a swap never blocks
//! calls and in-flight calls finish on the version they started with.
//! Request-time calls (`route_if_bound`, `select_if_bound`) run on the
//! host's own few call threads (`policy/pool.rs`), never the caller's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use wasmtime::component::{Component, Linker};

use super::bindings::{Packed, dataset, router};
use super::engine::{HostConfig, PolicyEngine};
use super::error::{FailureKind, PolicyError};
use super::metrics::{Counters, PolicyMetrics};
use super::pool::{CallPool, PolicyCall};
use super::reuse::fact_names;
use super::runtime::{Bound, Budget, Failure, HostState, LoadedPolicy, truncate};
use super::storage::{Bindings, Storage, StoredMeta, sha256_hex};
use super::types::Limits;
use super::types::{
    API_VERSION, AdapterInfo, BackendKind, BackendState, LoadOrigin, PolicyInfo, PolicyKind,
    PolicyOptions, RecordOutcome, RequestFacts, RouteDecision,
};

/// Largest configuration string: it is copied into every fresh instance.
const MAX_CONFIG_BYTES: usize = 1 << 20;
/// Most adapters a selector may return.
const MAX_ADAPTERS: usize = 64;

#[derive(Default)]
struct Snapshot {
    policies: HashMap<String, Arc<LoadedPolicy>>,
    bindings: Bindings,
}

impl Snapshot {
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
        let linker = Linker::new(&engine.engine);
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

    // ------------------------------------------------------------------
    // Management
    // ------------------------------------------------------------------

    /// Validates, compiles, test-calls and stores a policy, replacing any
    /// previous version of `name` atomically. Validation, in order: name and
    /// limits; size; Wasm header (component, not core module); compilation;
    /// the exported interface (kind and version); imports (none allowed);
    /// export types; `init(config)`; one synthetic call within the limits.
    pub fn upload(
        &self,
        name: &str,
        kind: PolicyKind,
        bytes: &[u8],
        opts: PolicyOptions,
    ) -> Result<PolicyInfo, PolicyError> {
        validate_name(name)?;
        let limits = opts.limits.unwrap_or_else(|| kind.default_limits());
        self.validate_limits(kind, &limits)?;
        if bytes.len() > self.cfg.max_component_bytes {
            return Err(PolicyError::TooLarge {
                size: bytes.len(),
                max: self.cfg.max_component_bytes,
            });
        }
        if let Some(size) = opts.config.as_ref().map(String::len)
            && size > MAX_CONFIG_BYTES
        {
            return Err(PolicyError::ConfigTooLarge {
                size,
                max: MAX_CONFIG_BYTES,
            });
        }
        check_header(bytes)?;
        let engine = &self.engine.engine;
        let artifact = engine
            .precompile_component(bytes)
            .map_err(|e| PolicyError::Malformed(truncate(format!("{e:#}"), 2048)))?;
        // SAFETY: `artifact` was produced just above by this engine.
        let component = unsafe { Component::deserialize(engine, &artifact) }
            .map_err(|e| PolicyError::Engine(format!("{e:#}")))?;
        let interface = exported_interface(engine, &component, kind)?;

        let _admin = self.admin.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.snap();
        let previous = current.policies.get(name);
        if let Some(prev) = previous {
            let bound = current.bindings.kinds_of(name);
            if prev.info.kind != kind && !bound.is_empty() {
                return Err(PolicyError::InUse {
                    name: name.to_string(),
                    kind: bound[0],
                });
            }
        }
        let sha = sha256_hex(bytes);
        let mut info = PolicyInfo {
            name: name.to_string(),
            kind,
            sha256: sha.clone(),
            size_bytes: bytes.len() as u64,
            interface,
            limits,
            on_error: opts.on_error,
            config: opts.config,
            uploaded_at: crate::util::time::unix_secs(),
            version: previous.map_or(1, |p| p.info.version + 1),
            origin: LoadOrigin::Uploaded,
            bound_as: vec![],
            decision_inputs: None,
        };
        // Fresh counters for validation so probe calls do not count; the
        // name's real counters are attached once the policy is accepted.
        let probe = LoadedPolicy::new(
            engine,
            &self.linker,
            &component,
            info.clone(),
            Arc::new(Counters::default()),
            Arc::clone(&self.engine.watchdog),
            self.cfg.max_calls_per_instance,
        )?;
        info.decision_inputs = synthetic_call(&probe)?;

        self.storage.save_blob(&sha, bytes)?;
        self.storage
            .save_artifact(&sha, &self.engine.compat_key, &artifact)?;
        self.storage.save_meta(&to_meta(&info))?;
        let loaded = LoadedPolicy::new(
            engine,
            &self.linker,
            &component,
            info,
            self.counters_for(name),
            Arc::clone(&self.engine.watchdog),
            self.cfg.max_calls_per_instance,
        )?;
        let old_sha = previous.map(|p| p.info.sha256.clone());
        let mut snap = self.clone_snap();
        let loaded = Arc::new(loaded);
        snap.policies.insert(name.to_string(), loaded.clone());
        let info = Self::info_of(&loaded, &snap.bindings);
        self.publish(snap);
        if let Some(old) = old_sha.filter(|s| *s != sha) {
            self.gc_content(&old);
        }
        Ok(info)
    }

    /// All policies, sorted by name.
    pub fn list(&self) -> Vec<PolicyInfo> {
        let snap = self.snap();
        let mut out: Vec<_> = snap
            .policies
            .values()
            .map(|p| Self::info_of(p, &snap.bindings))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    pub fn get(&self, name: &str) -> Result<PolicyInfo, PolicyError> {
        let snap = self.snap();
        snap.policies
            .get(name)
            .map(|p| Self::info_of(p, &snap.bindings))
            .ok_or_else(|| PolicyError::NotFound(name.to_string()))
    }

    /// Deletes a policy that is not bound. In-flight calls finish normally.
    pub fn remove(&self, name: &str) -> Result<(), PolicyError> {
        let _admin = self.admin.lock().unwrap_or_else(PoisonError::into_inner);
        let mut snap = self.clone_snap();
        if let Some(kind) = snap.bindings.kinds_of(name).first() {
            return Err(PolicyError::InUse {
                name: name.to_string(),
                kind: *kind,
            });
        }
        let removed = snap
            .policies
            .remove(name)
            .ok_or_else(|| PolicyError::NotFound(name.to_string()))?;
        self.storage.remove_meta(name)?;
        self.publish(snap);
        self.counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
        self.gc_content(&removed.info.sha256);
        Ok(())
    }

    /// Makes `name` the policy consulted for `kind` (router or
    /// adapter-selector). Takes effect for calls that start afterwards.
    pub fn bind(&self, kind: PolicyKind, name: &str) -> Result<(), PolicyError> {
        if !kind.is_bindable() {
            return Err(PolicyError::NotBindable(kind));
        }
        let _admin = self.admin.lock().unwrap_or_else(PoisonError::into_inner);
        let mut snap = self.clone_snap();
        let p = snap
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
        snap.bindings.set(kind, Some(name.to_string()));
        self.storage.save_bindings(&snap.bindings)?;
        self.publish(snap);
        Ok(())
    }

    /// Removes the binding for `kind`; callers then use their defaults.
    pub fn unbind(&self, kind: PolicyKind) -> Result<(), PolicyError> {
        if !kind.is_bindable() {
            return Err(PolicyError::NotBindable(kind));
        }
        let _admin = self.admin.lock().unwrap_or_else(PoisonError::into_inner);
        let mut snap = self.clone_snap();
        snap.bindings.set(kind, None);
        self.storage.save_bindings(&snap.bindings)?;
        self.publish(snap);
        Ok(())
    }

    /// The policy bound for `kind`, if any.
    pub fn binding(&self, kind: PolicyKind) -> Option<String> {
        self.snap().bindings.get(kind).cloned()
    }

    /// Metrics of every loaded policy, sorted by name.
    pub fn metrics(&self) -> Vec<PolicyMetrics> {
        let snap = self.snap();
        let mut out: Vec<_> = snap
            .policies
            .values()
            .map(|p| p.counters.snapshot(&p.info.name, p.info.kind))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Warm instances pooled for `name` (diagnostics and tests).
    pub fn warm_instances(&self, name: &str) -> Option<usize> {
        self.snap().policies.get(name).map(|p| p.warm_count())
    }

    // ------------------------------------------------------------------
    // Calls
    // ------------------------------------------------------------------

    /// Asks the bound router where to send a request. On `Err`, callers check
    /// [`PolicyError::is_fail_open`]: true (nothing bound, or a failing
    /// `fail_open` policy) means "use the default route"; false means refuse
    /// with [`PolicyError::status`] (503).
    pub fn route(
        &self,
        facts: &RequestFacts,
        backends: &[BackendState],
    ) -> Result<RouteDecision, PolicyError> {
        let snap = self.snap();
        decide(snap.bound(PolicyKind::Router)?, facts, || backends)
    }

    /// [`PolicyHost::route`] for the request path, to be awaited: the facts
    /// are only gathered when a router is bound (else `Err(NotBound)`, which
    /// is fail-open), and the backend states only when the guest is called.
    /// A reused decision (`policy/reuse.rs`) is answered here, a table
    /// lookup; a guest call runs on the host's call threads
    /// (`policy/pool.rs`), never on the caller's thread, and fails as a
    /// `capacity` failure when their queue is full.
    pub fn route_if_bound<'a>(
        &self,
        facts: impl FnOnce() -> RequestFacts<'a>,
        backends: impl FnOnce() -> Vec<BackendState>,
    ) -> PolicyCall<RouteDecision> {
        let snap = self.snap();
        let p = match snap.bound_arc(PolicyKind::Router) {
            Ok(p) => p,
            Err(e) => return PolicyCall::ready(Err(e)),
        };
        let facts = facts();
        let key = match &p.decisions {
            Some(table) => {
                let key = table.key(&facts);
                if let Some(decision) = table.get(&key) {
                    p.counters.decision_reused();
                    return PolicyCall::ready(Ok(decision));
                }
                Some(key)
            }
            None => None,
        };
        let args = Packed::router(&facts, &backends());
        self.off_thread(Arc::clone(p), move |p| {
            let decision = route_packed(p, &args)?;
            if let (Some(table), Some(key)) = (&p.decisions, key) {
                table.insert(key, decision.clone());
            }
            Ok(decision)
        })
    }

    /// Runs `f` on a call thread; a full queue fails like the guest would,
    /// with `capacity`, under the policy's `on_error`.
    fn off_thread<T: Send + 'static>(
        &self,
        p: Arc<LoadedPolicy>,
        f: impl FnOnce(&LoadedPolicy) -> Result<T, PolicyError> + Send + 'static,
    ) -> PolicyCall<T> {
        let refused = Arc::clone(&p);
        match self.calls.submit(move || f(&p)) {
            Ok(call) => call,
            Err(full) => {
                refused
                    .counters
                    .record(std::time::Duration::ZERO, Some(FailureKind::Capacity));
                PolicyCall::ready(Err(guest_error(
                    &refused,
                    (
                        FailureKind::Capacity,
                        format!(
                            "all {} policy call threads are busy and {} calls are queued; \
                             the call was not made (lower the policy's deadline or fix a slow policy)",
                            full.threads, full.queue
                        ),
                    ),
                )))
            }
        }
    }

    /// Asks the router policy `name` directly (dry runs, tests).
    pub fn route_with(
        &self,
        name: &str,
        facts: &RequestFacts,
        backends: &[BackendState],
    ) -> Result<RouteDecision, PolicyError> {
        let p = self.policy(name, PolicyKind::Router)?;
        decide(&p, facts, || backends)
    }

    /// Asks the bound adapter selector which mounted adapters apply, in
    /// order. `Ok(None)`: no opinion. Every returned id is one of `adapters`.
    pub fn select_adapters(
        &self,
        facts: &RequestFacts,
        adapters: &[AdapterInfo],
    ) -> Result<Option<Vec<String>>, PolicyError> {
        let snap = self.snap();
        select_on(snap.bound(PolicyKind::AdapterSelector)?, facts, adapters)
    }

    /// [`PolicyHost::select_adapters`] for the request path, to be awaited:
    /// the guest call runs on the host's call threads, like
    /// [`PolicyHost::route_if_bound`]'s.
    pub fn select_if_bound(
        &self,
        facts: &RequestFacts,
        adapters: Vec<AdapterInfo>,
    ) -> PolicyCall<Option<Vec<String>>> {
        let p = match self.snap().bound_arc(PolicyKind::AdapterSelector) {
            Ok(p) => Arc::clone(p),
            Err(e) => return PolicyCall::ready(Err(e)),
        };
        let args = Packed::selector(facts, &adapters);
        self.off_thread(p, move |p| select_packed(p, &args, &adapters))
    }

    /// Calls the adapter-selector policy `name` directly.
    pub fn select_adapters_with(
        &self,
        name: &str,
        facts: &RequestFacts,
        adapters: &[AdapterInfo],
    ) -> Result<Option<Vec<String>>, PolicyError> {
        let p = self.policy(name, PolicyKind::AdapterSelector)?;
        select_on(&p, facts, adapters)
    }

    /// Runs the dataset-transform policy `name` on a batch, one outcome per
    /// record, in order. The batch gets `len` times the per-record budget; if
    /// it fails as a whole (trap, budget, memory, wrong outcome count), each
    /// record is retried alone with its own budget, so one bad record only
    /// costs its own `Error` outcome. Keep batches modest (tens of records)
    /// so they fit the memory cap. `Err` only for policy-level problems
    /// (unknown policy, wrong kind).
    pub fn transform_batch(
        &self,
        name: &str,
        records: &[String],
    ) -> Result<Vec<RecordOutcome>, PolicyError> {
        let p = self.policy(name, PolicyKind::DatasetTransform)?;
        if records.is_empty() {
            return Ok(vec![]);
        }
        match transform_on(&p, records) {
            Ok(out) => Ok(out),
            Err((kind, detail)) if records.len() == 1 => Ok(vec![RecordOutcome::Error(format!(
                "policy {kind}: {detail}"
            ))]),
            Err(_) => Ok(records
                .iter()
                .map(|r| match transform_on(&p, std::slice::from_ref(r)) {
                    Ok(mut v) => v.pop().unwrap_or_else(|| {
                        RecordOutcome::Error("policy returned no outcome".to_string())
                    }),
                    Err((kind, detail)) => RecordOutcome::Error(format!("policy {kind}: {detail}")),
                })
                .collect()),
        }
    }

    fn policy(&self, name: &str, kind: PolicyKind) -> Result<Arc<LoadedPolicy>, PolicyError> {
        let p = self
            .snap()
            .policies
            .get(name)
            .cloned()
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

    // ------------------------------------------------------------------
    // Internals
    // ------------------------------------------------------------------

    /// The longest deadline a `kind` policy may have: request-time kinds
    /// (router, adapter selector) have a lower ceiling than jobs' transforms.
    fn max_deadline_ms(&self, kind: PolicyKind) -> u32 {
        if kind.is_bindable() {
            self.cfg
                .max_request_deadline_ms
                .min(self.cfg.max_deadline_ms)
        } else {
            self.cfg.max_deadline_ms
        }
    }

    fn validate_limits(&self, kind: PolicyKind, l: &Limits) -> Result<(), PolicyError> {
        let bad = |m: String| Err(PolicyError::InvalidLimits(m));
        let max_deadline = self.max_deadline_ms(kind);
        if l.deadline_ms == 0 || l.deadline_ms > max_deadline {
            let why = if kind.is_bindable() {
                " (every request waits for a request-time policy)"
            } else {
                ""
            };
            return bad(format!(
                "deadline_ms is {}; a {kind} policy's must be 1..={max_deadline}{why}",
                l.deadline_ms
            ));
        }
        if l.memory_bytes < (1 << 20) || l.memory_bytes > self.cfg.max_memory_bytes {
            return bad(format!(
                "memory_bytes must be 1 MiB..={} bytes",
                self.cfg.max_memory_bytes
            ));
        }
        if l.fuel == Some(0) {
            return bad("fuel must be positive".to_string());
        }
        if l.warm_instances > 64 {
            return bad("warm_instances must be at most 64".to_string());
        }
        if l.max_output_bytes == 0 || l.max_output_bytes > (64 << 20) {
            return bad("max_output_bytes must be 1..=64 MiB".to_string());
        }
        Ok(())
    }

    /// Loads a stored policy: the artifact when present and valid for this
    /// engine, else recompiles from the stored bytes (and stores the new
    /// artifact).
    fn reload(&self, meta: StoredMeta) -> Result<LoadedPolicy, PolicyError> {
        validate_name(&meta.name)?;
        let engine = &self.engine.engine;
        let compat = &self.engine.compat_key;
        let from_artifact = self
            .storage
            .load_artifact(&meta.sha256, compat)
            // SAFETY: only artifacts this gateway wrote, whose digest (also
            // written by us) matches, reach `deserialize`.
            .and_then(|a| unsafe { Component::deserialize(engine, &a) }.ok());
        let (component, origin) = match from_artifact {
            Some(c) => (c, LoadOrigin::Artifact),
            None => {
                let bytes = self.storage.load_blob(&meta.sha256)?;
                let artifact = engine
                    .precompile_component(&bytes)
                    .map_err(|e| PolicyError::Malformed(format!("{}: {e:#}", meta.name)))?;
                // SAFETY: produced just above by this engine.
                let c = unsafe { Component::deserialize(engine, &artifact) }
                    .map_err(|e| PolicyError::Engine(format!("{e:#}")))?;
                self.storage
                    .save_artifact(&meta.sha256, compat, &artifact)?;
                (c, LoadOrigin::Recompiled)
            }
        };
        let mut limits = meta.limits;
        let max_deadline = self.max_deadline_ms(meta.kind);
        if limits.deadline_ms > max_deadline {
            tracing::warn!(
                policy = %meta.name,
                stored = limits.deadline_ms,
                ceiling = max_deadline,
                "policy deadline over the ceiling for its kind; lowered to the ceiling"
            );
            limits.deadline_ms = max_deadline;
        }
        let info = PolicyInfo {
            name: meta.name.clone(),
            kind: meta.kind,
            sha256: meta.sha256,
            size_bytes: meta.size_bytes,
            interface: meta.interface,
            limits,
            on_error: meta.on_error,
            config: meta.config,
            uploaded_at: meta.uploaded_at,
            version: meta.version,
            origin,
            bound_as: vec![],
            decision_inputs: meta.decision_inputs,
        };
        LoadedPolicy::new(
            engine,
            &self.linker,
            &component,
            info,
            self.counters_for(&meta.name),
            Arc::clone(&self.engine.watchdog),
            self.cfg.max_calls_per_instance,
        )
    }

    /// Deletes stored bytes no longer referenced by any policy.
    fn gc_content(&self, sha: &str) {
        if !self.snap().policies.values().any(|p| p.info.sha256 == sha) {
            self.storage.remove_content(sha);
        }
    }
}

fn to_meta(info: &PolicyInfo) -> StoredMeta {
    StoredMeta {
        name: info.name.clone(),
        kind: info.kind,
        sha256: info.sha256.clone(),
        size_bytes: info.size_bytes,
        interface: info.interface.clone(),
        limits: info.limits,
        on_error: info.on_error,
        config: info.config.clone(),
        uploaded_at: info.uploaded_at,
        version: info.version,
        decision_inputs: info.decision_inputs.clone(),
    }
}

/// Names are file names and URL path segments: keep them boring.
fn validate_name(name: &str) -> Result<(), PolicyError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(PolicyError::InvalidName(truncate(name.to_string(), 80)))
    }
}

/// Tells a component from a core module from anything else, before the
/// compiler sees the bytes, so the error can say what to do.
fn check_header(bytes: &[u8]) -> Result<(), PolicyError> {
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(PolicyError::NotWasm(
            "missing the \\0asm magic number".to_string(),
        ));
    }
    match (&bytes[4..6], &bytes[6..8]) {
        (_, [1, 0]) => Ok(()),
        ([1, 0], [0, 0]) => Err(PolicyError::CoreModule),
        (v, l) => Err(PolicyError::NotWasm(format!(
            "unknown binary version {v:?} layer {l:?}"
        ))),
    }
}

/// Finds the interface of `kind` among the component's exports and checks its
/// version; says precisely what is wrong otherwise.
fn exported_interface(
    engine: &wasmtime::Engine,
    component: &Component,
    kind: PolicyKind,
) -> Result<String, PolicyError> {
    let ty = component.component_type();
    let names: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
    let wanted = kind.interface();
    if let Some(found) = names.iter().find(|n| n.starts_with(&format!("{wanted}@"))) {
        let version = &found[wanted.len() + 1..];
        let compatible = version
            .strip_prefix(API_VERSION)
            .is_some_and(|patch| patch.starts_with('.'));
        if compatible {
            return Ok(found.clone());
        }
        return Err(PolicyError::IncompatibleVersion {
            expected: wanted,
            found: found.clone(),
        });
    }
    for other in PolicyKind::ALL {
        let iface = other.interface();
        if let Some(found) = names
            .iter()
            .find(|n| n.starts_with(&format!("{iface}@")) || **n == iface)
        {
            return Err(PolicyError::WrongKind {
                expected: kind,
                found_kind: other,
                found: found.clone(),
            });
        }
    }
    let listed = if names.is_empty() {
        "none".to_string()
    } else {
        truncate(names.join(", "), 512)
    };
    Err(PolicyError::MissingExport {
        expected: wanted,
        exports: listed,
    })
}

fn guest_error(p: &LoadedPolicy, (kind, detail): Failure) -> PolicyError {
    PolicyError::Guest {
        policy: p.info.name.clone(),
        kind,
        on_error: p.info.on_error,
        detail,
    }
}

fn bad_output(msg: impl Into<String>) -> Failure {
    (FailureKind::BadOutput, msg.into())
}

/// The router `p`'s decision for `facts`: a reused one when `p` declared its
/// decision inputs and a request agreeing on them was decided before (see
/// `policy/reuse.rs`), else a call, whose decision is then kept.
fn decide<B: AsRef<[BackendState]>>(
    p: &LoadedPolicy,
    facts: &RequestFacts,
    backends: impl FnOnce() -> B,
) -> Result<RouteDecision, PolicyError> {
    let Some(table) = &p.decisions else {
        return route_on(p, facts, backends().as_ref());
    };
    let key = table.key(facts);
    if let Some(decision) = table.get(&key) {
        p.counters.decision_reused();
        return Ok(decision);
    }
    let decision = route_on(p, facts, backends().as_ref())?;
    table.insert(key, decision.clone());
    Ok(decision)
}

/// The facts a router declares its decisions depend on (WIT names), asked
/// once at upload.
fn declared_inputs(p: &LoadedPolicy) -> Result<Option<Vec<String>>, PolicyError> {
    p.call(Budget::of(&p.info.limits, 1), |store, b| match b {
        Bound::Router(r) => r.mlxgate_policy_router().call_decision_inputs(store),
        _ => wasmtime::bail!("not a router"),
    })
    .map(|inputs| inputs.map(fact_names))
    .map_err(|f| guest_error(p, f))
}

fn route_on(
    p: &LoadedPolicy,
    facts: &RequestFacts,
    backends: &[BackendState],
) -> Result<RouteDecision, PolicyError> {
    route_packed(p, &Packed::router(facts, backends))
}

/// The router call itself, on arguments already packed (owned, so they can
/// go to a call thread).
fn route_packed(
    p: &LoadedPolicy,
    args: &Packed<router::mlxgate::policy::types::BackendState>,
) -> Result<RouteDecision, PolicyError> {
    let start = Instant::now();
    let res = p
        .call(Budget::of(&p.info.limits, 1), |store, b| match b {
            Bound::Router(r) => {
                r.mlxgate_policy_router()
                    .call_route(store, &args.facts, &args.items)
            }
            _ => wasmtime::bail!("not a router"),
        })
        .and_then(|d| check_route(d, p.info.limits.max_output_bytes));
    p.counters
        .record(start.elapsed(), res.as_ref().err().map(|f| f.0));
    res.map_err(|f| guest_error(p, f))
}

fn check_route(
    d: router::exports::mlxgate::policy::router::RouteDecision,
    max: usize,
) -> Result<RouteDecision, Failure> {
    use router::exports::mlxgate::policy::router::RouteDecision as W;
    let sized = |what: &str, s: &str| {
        if s.len() > max {
            Err(bad_output(format!(
                "{what} is {} bytes, over the {max}-byte output limit",
                s.len()
            )))
        } else {
            Ok(())
        }
    };
    match d {
        W::Local(model) => {
            sized("model", &model)?;
            if model.is_empty() {
                return Err(bad_output("empty local model name"));
            }
            Ok(RouteDecision::Local { model })
        }
        W::Upstream(t) => {
            sized("upstream name", &t.name)?;
            if let Some(m) = &t.model {
                sized("model", m)?;
            }
            if t.name.is_empty() {
                return Err(bad_output("empty upstream name"));
            }
            Ok(RouteDecision::Upstream {
                name: t.name,
                model: t.model,
            })
        }
        W::Reject(r) => {
            sized("reject message", &r.message)?;
            if !(400..=599).contains(&r.status) {
                return Err(bad_output(format!(
                    "reject status {} is not 4xx/5xx",
                    r.status
                )));
            }
            Ok(RouteDecision::Reject {
                status: r.status,
                message: r.message,
            })
        }
    }
}

fn select_on(
    p: &LoadedPolicy,
    facts: &RequestFacts,
    adapters: &[AdapterInfo],
) -> Result<Option<Vec<String>>, PolicyError> {
    select_packed(p, &Packed::selector(facts, adapters), adapters)
}

/// The selector call itself, on arguments already packed; `adapters` are
/// the ones packed, to check the answer against.
fn select_packed(
    p: &LoadedPolicy,
    args: &Packed<router::mlxgate::policy::types::AdapterInfo>,
    adapters: &[AdapterInfo],
) -> Result<Option<Vec<String>>, PolicyError> {
    let start = Instant::now();
    let res = p
        .call(Budget::of(&p.info.limits, 1), |store, b| match b {
            Bound::Adapter(a) => {
                a.mlxgate_policy_adapter_selector()
                    .call_select(store, &args.facts, &args.items)
            }
            _ => wasmtime::bail!("not an adapter selector"),
        })
        .and_then(|ids| {
            let Some(ids) = ids else { return Ok(None) };
            if ids.len() > MAX_ADAPTERS {
                return Err(bad_output(format!(
                    "{} adapters returned, at most {MAX_ADAPTERS} allowed",
                    ids.len()
                )));
            }
            for (i, id) in ids.iter().enumerate() {
                if !adapters.iter().any(|a| &a.id == id) {
                    return Err(bad_output(format!(
                        "unknown adapter `{}`",
                        truncate(id.clone(), 128)
                    )));
                }
                if ids[..i].contains(id) {
                    return Err(bad_output(format!("adapter `{id}` returned twice")));
                }
            }
            Ok(Some(ids))
        });
    p.counters
        .record(start.elapsed(), res.as_ref().err().map(|f| f.0));
    res.map_err(|f| guest_error(p, f))
}

fn transform_on(p: &LoadedPolicy, records: &[String]) -> Result<Vec<RecordOutcome>, Failure> {
    use dataset::exports::mlxgate::policy::dataset_transform::RecordOutcome as W;
    let start = Instant::now();
    let max = p.info.limits.max_output_bytes;
    let units = records.len() as u64;
    let res = p
        .call(Budget::of(&p.info.limits, units), |store, b| match b {
            Bound::Dataset(d) => d
                .mlxgate_policy_dataset_transform()
                .call_transform(store, records),
            _ => wasmtime::bail!("not a dataset transform"),
        })
        .and_then(|outs| {
            if outs.len() != records.len() {
                return Err(bad_output(format!(
                    "{} outcomes for {} records",
                    outs.len(),
                    records.len()
                )));
            }
            Ok(outs
                .into_iter()
                .map(|o| match o {
                    W::Keep(s) if s.len() > max => RecordOutcome::Error(format!(
                        "output is {} bytes, over the {max}-byte limit",
                        s.len()
                    )),
                    W::Keep(s) => RecordOutcome::Keep(s),
                    W::Drop(s) => RecordOutcome::Drop(truncate(s, 1024)),
                    W::Error(s) => RecordOutcome::Error(truncate(s, 1024)),
                })
                .collect())
        });
    p.counters
        .record(start.elapsed(), res.as_ref().err().map(|f| f.0));
    res
}

/// Facts of the upload probe call. Policies see model `mlxgate-probe`.
pub fn probe_facts() -> RequestFacts<'static> {
    RequestFacts {
        method: "POST",
        path: "/v1/chat/completions",
        model: "mlxgate-probe",
        headers: vec![],
        api_key_id: None,
        tenant: None,
        prompt_tokens: 16,
        max_tokens: Some(16),
        streaming: false,
    }
}

/// One call on the freshly loaded policy, within its limits, at upload; for
/// a router, also its declared decision inputs. A timeout is retried once:
/// a guest that loops fails twice, while a thread stalled by the OS for a
/// few milliseconds should not fail an upload.
fn synthetic_call(p: &LoadedPolicy) -> Result<Option<Vec<String>>, PolicyError> {
    match probe_once(p) {
        Err(PolicyError::ValidationFailed {
            kind: FailureKind::Timeout,
            ..
        }) => probe_once(p),
        other => other,
    }
}

fn probe_once(p: &LoadedPolicy) -> Result<Option<Vec<String>>, PolicyError> {
    let facts = probe_facts();
    let outcome = match p.info.kind {
        PolicyKind::Router => {
            let backends = [BackendState {
                name: "mlxgate-probe".to_string(),
                kind: BackendKind::Local,
                healthy: true,
                in_flight: 0,
                queue_depth: 0,
            }];
            route_on(p, &facts, &backends).and_then(|_| declared_inputs(p))
        }
        PolicyKind::AdapterSelector => {
            let adapters = [AdapterInfo {
                id: "mlxgate-probe-adapter".to_string(),
                rank: 8,
                scale: 1.0,
                base_model: "mlxgate-probe".to_string(),
            }];
            select_on(p, &facts, &adapters).map(|_| None)
        }
        PolicyKind::DatasetTransform => transform_on(p, &["{}".to_string()])
            .map_err(|f| guest_error(p, f))
            .map(|_| None),
    };
    match outcome {
        Ok(inputs) => Ok(inputs),
        Err(PolicyError::Guest {
            kind: FailureKind::InitFailed,
            detail,
            ..
        }) => Err(PolicyError::InitRejected(detail)),
        Err(PolicyError::Guest { kind, detail, .. }) => {
            Err(PolicyError::ValidationFailed { kind, detail })
        }
        Err(other) => Err(other),
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
