//! Warm router call through the policy host vs the same logic as a native
//! Rust function (the in-run peer), plus a fresh instance per call for scale.
//!
//! Run: `scripts/build-policies.sh && cargo bench -p mlxgate --bench policy_router`
//! (`POLICY_ROUTER_PROFILE=SECS` makes only warm calls for SECS seconds, for
//! `perf record`, or `perf stat -e task-clock` at two durations for CPU time
//! per call on a noisy machine).
//! Each figure is per call, from individually timed calls (so each includes
//! ~20-30 ns of `Instant::now()` overhead); the native peer is also given as a
//! batched mean, which excludes that overhead.

use std::collections::HashMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use mlxgate::policy::{
    BackendKind, BackendState, HostConfig, Limits, PolicyHost, PolicyKind, PolicyOptions,
    RequestFacts, RouteDecision,
};

const CALLS: usize = 20_000;

/// A built example policy (`alias_router`, `tenant_router`).
fn component(crate_name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../policies/target/wasm32-unknown-unknown/release/{crate_name}.wasm"
    ));
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{} missing ({e}): run scripts/build-policies.sh",
            path.display()
        )
    })
}

fn facts() -> RequestFacts<'static> {
    RequestFacts {
        method: "POST",
        path: "/v1/chat/completions",
        model: "gpt-4o",
        headers: vec![("x-tenant", "acme")],
        api_key_id: Some("web"),
        tenant: Some("acme"),
        prompt_tokens: 812,
        max_tokens: Some(256),
        streaming: true,
        quota: Default::default(),
    }
}

fn backends() -> Vec<BackendState> {
    ["llama-3-8b", "qwen-7b", "openai", "anthropic"]
        .iter()
        .enumerate()
        .map(|(i, n)| BackendState {
            name: n.to_string(),
            kind: if i < 2 {
                BackendKind::Local
            } else {
                BackendKind::Upstream
            },
            healthy: true,
            in_flight: i as u32,
            queue_depth: 0,
            latency_ms: None,
        })
        .collect()
}

/// The alias router's logic, natively.
fn native_route(
    aliases: &HashMap<String, String>,
    facts: &RequestFacts,
    backends: &[BackendState],
) -> RouteDecision {
    let target = aliases.get(facts.model).map_or(facts.model, String::as_str);
    if backends
        .iter()
        .any(|b| b.kind == BackendKind::Local && b.name == target)
    {
        RouteDecision::local(target.to_string())
    } else {
        RouteDecision::Reject {
            status: 404,
            message: format!("The model `{}` does not exist", facts.model),
        }
    }
}

fn stats(name: &str, mut ns: Vec<u64>) {
    ns.sort_unstable();
    let q = |p: f64| ns[((ns.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
    println!(
        "{name:<44} median {:>8.3} us   p99 {:>8.3} us   max {:>9.3} us",
        q(0.5),
        q(0.99),
        q(1.0)
    );
}

fn time_calls(mut f: impl FnMut()) -> Vec<u64> {
    for _ in 0..2_000 {
        f();
    }
    (0..CALLS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as u64
        })
        .collect()
}

fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    let host = PolicyHost::open(HostConfig::new(dir.path())).expect("policy host");
    let config = r#"{"aliases": {"gpt-4o": "llama-3-8b"}}"#;
    let bytes = component("alias_router");
    let upload = |name: &str, warm: u32| {
        let limits = Limits {
            warm_instances: warm,
            deadline_ms: 100,
            ..PolicyKind::Router.default_limits()
        };
        let t = Instant::now();
        host.upload(
            name,
            PolicyKind::Router,
            &bytes,
            PolicyOptions {
                limits: Some(limits),
                config: Some(config.into()),
                ..PolicyOptions::default()
            },
        )
        .expect("upload");
        t.elapsed()
    };
    let took = upload("warm", 1);
    upload("fresh", 0);
    host.bind(PolicyKind::Router, "warm").expect("bind");

    let (f, b) = (facts(), backends());
    let expected = RouteDecision::local("llama-3-8b");
    assert_eq!(host.route(&f, &b).expect("route"), expected);
    let aliases: HashMap<String, String> =
        HashMap::from([("gpt-4o".to_string(), "llama-3-8b".to_string())]);
    assert_eq!(native_route(&aliases, &f, &b), expected);

    // `POLICY_ROUTER_PROFILE=SECS`: only warm calls, for SECS seconds, for
    // a profiler (`perf record`) to look at.
    if let Some(secs) = std::env::var("POLICY_ROUTER_PROFILE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
    {
        let until = Instant::now() + std::time::Duration::from_secs_f64(secs);
        let mut calls = 0u64;
        while Instant::now() < until {
            for _ in 0..1000 {
                black_box(host.route(black_box(&f), black_box(&b)).ok());
            }
            calls += 1000;
        }
        println!("{calls} warm calls in {secs} s");
        return;
    }
    println!(
        "policy_router: alias-router component {} bytes; upload (validate + compile + probe) {:.1} ms; {CALLS} timed calls each",
        bytes.len(),
        took.as_secs_f64() * 1e3
    );
    stats(
        "native Rust function",
        time_calls(|| {
            black_box(native_route(
                black_box(&aliases),
                black_box(&f),
                black_box(&b),
            ));
        }),
    );
    let t = Instant::now();
    for _ in 0..CALLS {
        black_box(native_route(
            black_box(&aliases),
            black_box(&f),
            black_box(&b),
        ));
    }
    println!(
        "{:<44} mean   {:>8.3} us",
        "native Rust function, batched",
        t.elapsed().as_secs_f64() * 1e6 / CALLS as f64
    );
    stats(
        "wasm router, warm instance (host.route)",
        time_calls(|| {
            black_box(host.route(black_box(&f), black_box(&b)).ok());
        }),
    );
    let fresh: Vec<u64> = {
        let calls = CALLS / 10;
        (0..calls)
            .map(|_| {
                let t = Instant::now();
                black_box(host.route_with("fresh", &f, &b).ok());
                t.elapsed().as_nanos() as u64
            })
            .collect()
    };
    stats("wasm router, fresh instance per call (+init)", fresh);

    // The tenant router declares its decision inputs (tenant, headers,
    // model): after the first call its decision is reused.
    host.upload(
        "reused",
        PolicyKind::Router,
        &component("tenant_router"),
        PolicyOptions {
            config: Some(r#"{"tenants": {"acme": {"local": "llama-3-8b"}}}"#.into()),
            ..PolicyOptions::default()
        },
    )
    .expect("upload tenant_router");
    assert_eq!(host.route_with("reused", &f, &b).expect("route"), expected);
    stats(
        "wasm router, decision reused (tenant-router)",
        time_calls(|| {
            black_box(host.route_with("reused", black_box(&f), black_box(&b)).ok());
        }),
    );
}
