//! Shared helpers for the policy tests: built guest components, a host on a
//! temporary data dir, request facts.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use mlxgate::policy::{
    AdapterInfo, BackendKind, BackendState, HostConfig, Limits, PolicyHost, PolicyKind,
    PolicyOptions, RequestFacts,
};

/// The HTTP status a policy error answers with.
pub fn status(e: &mlxgate::policy::PolicyError) -> u16 {
    mlxgate::http::error::policy_status(e).as_u16()
}

/// Bytes of a guest built by `scripts/build-policies.sh`.
pub fn wasm(crate_name: &str) -> Vec<u8> {
    wasm_for("wasm32-unknown-unknown", crate_name)
}

/// Bytes of a guest built for `target` by `scripts/build-policies.sh`.
pub fn wasm_for(target: &str, crate_name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../policies/target")
        .join(target)
        .join("release")
        .join(format!("{}.wasm", crate_name.replace('-', "_")));
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "guest component {} is missing ({e}): run scripts/build-policies.sh first",
            path.display()
        )
    })
}

/// A host with small pools, on `dir`.
pub fn host(dir: &Path) -> PolicyHost {
    let mut cfg = HostConfig::new(dir);
    cfg.max_instances = 32;
    cfg.max_memory_bytes = 64 << 20;
    PolicyHost::open(cfg).expect("open policy host")
}

pub fn opts(config: &str) -> PolicyOptions {
    PolicyOptions {
        config: Some(config.to_string()),
        ..PolicyOptions::default()
    }
}

/// Uploads with a roomy deadline: these tests check behaviour, and a loaded
/// 2-core CI machine can stall a thread for longer than the 5 ms default.
pub fn upload(host: &PolicyHost, name: &str, kind: PolicyKind, crate_name: &str, config: &str) {
    upload_bytes(host, name, kind, &wasm(crate_name), config)
        .unwrap_or_else(|e| panic!("upload {name}: {e}"));
}

/// Uploads a component's bytes with the same roomy deadline.
pub fn upload_bytes(
    host: &PolicyHost,
    name: &str,
    kind: PolicyKind,
    component: &[u8],
    config: &str,
) -> Result<(), mlxgate::policy::PolicyError> {
    let defaults = kind.default_limits();
    let limits = Limits {
        deadline_ms: defaults.deadline_ms.max(200),
        ..defaults
    };
    let opts = PolicyOptions {
        limits: Some(limits),
        ..opts(config)
    };
    host.upload(name, kind, component, opts).map(|_| ())
}

pub fn facts(model: &str) -> RequestFacts<'_> {
    RequestFacts {
        method: "POST",
        path: "/v1/chat/completions",
        model,
        headers: vec![],
        api_key_id: None,
        tenant: None,
        prompt_tokens: 100,
        max_tokens: Some(64),
        streaming: false,
        quota: Default::default(),
    }
}

pub fn tenant_facts<'a>(
    model: &'a str,
    tenant: Option<&'a str>,
    headers: &[(&'a str, &'a str)],
) -> RequestFacts<'a> {
    RequestFacts {
        tenant,
        headers: headers.to_vec(),
        ..facts(model)
    }
}

pub fn local(name: &str, in_flight: u32, queue_depth: u32) -> BackendState {
    BackendState {
        name: name.into(),
        kind: BackendKind::Local,
        healthy: true,
        in_flight,
        queue_depth,
        latency_ms: None,
    }
}

pub fn upstream(name: &str, in_flight: u32, queue_depth: u32) -> BackendState {
    BackendState {
        kind: BackendKind::Upstream,
        ..local(name, in_flight, queue_depth)
    }
}

pub fn adapter(id: &str, base: &str) -> AdapterInfo {
    AdapterInfo {
        id: id.into(),
        rank: 8,
        scale: 1.0,
        base_model: base.into(),
    }
}

pub fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}
