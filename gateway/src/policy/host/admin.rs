//! Operator-facing operations of [`PolicyHost`]: upload (validated, then
//! stored and published atomically), list, get, remove, bind, unbind,
//! metrics, and reloading a stored policy when the host opens. Each change
//! runs under the host's admin mutex and publishes a new snapshot.

use std::sync::{Arc, PoisonError};

use wasmtime::component::Component;

use super::PolicyHost;
use super::validation::{check_header, exported_interface, synthetic_call, validate_name};
use crate::policy::error::PolicyError;
use crate::policy::metrics::{Counters, PolicyMetrics};
use crate::policy::runtime::{LoadedPolicy, truncate};
use crate::policy::storage::{StoredMeta, sha256_hex};
use crate::policy::types::{Limits, LoadOrigin, PolicyInfo, PolicyKind, PolicyOptions};

/// Largest configuration string: it is copied into every fresh instance.
const MAX_CONFIG_BYTES: usize = 1 << 20;

impl PolicyHost {
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
        let limits = self.check_upload(name, kind, bytes, &opts)?;
        let engine = &self.engine.engine;
        let sha = sha256_hex(bytes);
        let (artifact, component) = self.compile_or_reuse(&sha, bytes)?;
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
        let probe = self.instantiate(&component, info.clone(), Arc::new(Counters::default()))?;
        info.decision_inputs = synthetic_call(&probe)?;

        self.storage.save_blob(&sha, bytes)?;
        self.storage
            .save_artifact(&sha, &self.engine.compat_key, &artifact)?;
        self.storage.save_meta(&to_meta(&info))?;
        let loaded = self.instantiate(&component, info, self.counters_for(name))?;
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
        snap.of_kind(name, kind)?;
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
    pub(super) fn reload(&self, meta: StoredMeta) -> Result<LoadedPolicy, PolicyError> {
        validate_name(&meta.name)?;
        let engine = &self.engine.engine;
        let compat = &self.engine.compat_key;
        let (component, origin) = match self.stored_component(&meta.sha256) {
            Some((_, c)) => (c, LoadOrigin::Artifact),
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
        self.instantiate(&component, info, self.counters_for(&meta.name))
    }

    /// The checks an upload passes before compiling, in order: name, limits,
    /// size, configuration size, Wasm header. The limits the policy gets.
    fn check_upload(
        &self,
        name: &str,
        kind: PolicyKind,
        bytes: &[u8],
        opts: &PolicyOptions,
    ) -> Result<Limits, PolicyError> {
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
        Ok(limits)
    }

    /// A compiled `component` with this host's linker, watchdog and
    /// per-instance call cap, its calls counted into `counters`.
    fn instantiate(
        &self,
        component: &Component,
        info: PolicyInfo,
        counters: Arc<Counters>,
    ) -> Result<LoadedPolicy, PolicyError> {
        LoadedPolicy::new(
            &self.engine.engine,
            &self.linker,
            component,
            info,
            counters,
            Arc::clone(&self.engine.watchdog),
            self.cfg.max_calls_per_instance,
        )
    }

    /// The compiled component for `bytes`: the stored artifact when another
    /// policy (or an earlier version of this one) already has the same
    /// content, so changing only a policy's config or limits skips the
    /// compilation (seconds for a Python or JavaScript guest's interpreter).
    fn compile_or_reuse(
        &self,
        sha: &str,
        bytes: &[u8],
    ) -> Result<(Vec<u8>, Component), PolicyError> {
        match self.stored_component(sha) {
            Some(found) => Ok(found),
            None => compile(&self.engine.engine, bytes),
        }
    }

    /// The stored artifact of `sha` for this engine, loaded, if present and
    /// intact.
    fn stored_component(&self, sha: &str) -> Option<(Vec<u8>, Component)> {
        let artifact = self.storage.load_artifact(sha, &self.engine.compat_key)?;
        // SAFETY: only artifacts this gateway wrote, whose digest (also
        // written by us) matches, reach `deserialize`.
        let component = unsafe { Component::deserialize(&self.engine.engine, &artifact) }.ok()?;
        Some((artifact, component))
    }

    /// Deletes stored bytes no longer referenced by any policy.
    fn gc_content(&self, sha: &str) {
        if !self.snap().policies.values().any(|p| p.info.sha256 == sha) {
            self.storage.remove_content(sha);
        }
    }
}

/// Compiles an uploaded component: the artifact to store, and the component
/// loaded from it.
fn compile(engine: &wasmtime::Engine, bytes: &[u8]) -> Result<(Vec<u8>, Component), PolicyError> {
    let artifact = engine
        .precompile_component(bytes)
        .map_err(|e| PolicyError::Malformed(truncate(format!("{e:#}"), 2048)))?;
    // SAFETY: `artifact` was produced just above by this engine.
    let component = unsafe { Component::deserialize(engine, &artifact) }
        .map_err(|e| PolicyError::Engine(format!("{e:#}")))?;
    Ok((artifact, component))
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
