//! Behaviour of each example policy in `policies/`, run on the real host.
//! Needs `scripts/build-policies.sh` to have run.

#[path = "policy_common/mod.rs"]
mod common;

use common::*;
use mlxgate::policy::{PolicyError, PolicyKind, RecordOutcome, RouteDecision};
use serde_json::{Value, json};

fn local_route(model: &str) -> RouteDecision {
    RouteDecision::local(model)
}

#[test]
fn alias_router_maps_aliases_and_rejects_unknown_models() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let cfg =
        json!({"aliases": {"gpt-4o": "llama-3-8b", "gpt-ghost": "nowhere"}, "models": ["qwen-7b"]});
    upload(
        &host,
        "alias",
        PolicyKind::Router,
        "alias-router",
        &cfg.to_string(),
    );
    let backends = [local("llama-3-8b", 0, 0)];

    let r = |m: &str| host.route_with("alias", &facts(m), &backends).unwrap();
    assert_eq!(r("gpt-4o"), local_route("llama-3-8b"));
    assert_eq!(r("llama-3-8b"), local_route("llama-3-8b"));
    assert_eq!(r("qwen-7b"), local_route("qwen-7b"));
    for unknown in ["gpt-5", "gpt-ghost"] {
        match r(unknown) {
            RouteDecision::Reject { status, message } => {
                assert_eq!(status, 404);
                assert!(message.contains(unknown), "{message}");
            }
            other => panic!("{unknown}: {other:?}"),
        }
    }
}

/// Calls and reused decisions of the policy `name` so far.
fn calls_and_reuses(host: &mlxgate::policy::PolicyHost, name: &str) -> (u64, u64) {
    let m = host.metrics().into_iter().find(|m| m.name == name).unwrap();
    (m.calls, m.decisions_reused)
}

#[test]
fn declared_decision_inputs_let_the_host_reuse_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let upload_tenants = |host: &mlxgate::policy::PolicyHost, cfg: Value| {
        upload(
            host,
            "tenants",
            PolicyKind::Router,
            "tenant-router",
            &cfg.to_string(),
        )
    };
    upload_tenants(
        &host,
        json!({"tenants": {"acme": {"local": "llama-3-8b"}, "globex": {"local": "qwen"}}}),
    );
    // The tenant router declares tenant, headers and model; the alias
    // router reads the backends, so it declares nothing.
    let info = host.get("tenants").unwrap();
    assert_eq!(
        info.decision_inputs.as_deref(),
        Some(&["model".to_string(), "headers".into(), "tenant".into()][..])
    );
    upload(
        &host,
        "alias",
        PolicyKind::Router,
        "alias-router",
        &json!({"aliases": {}}).to_string(),
    );
    assert_eq!(host.get("alias").unwrap().decision_inputs, None);

    host.bind(PolicyKind::Router, "tenants").unwrap();
    let acme = tenant_facts("m", Some("acme"), &[]);
    for _ in 0..50 {
        assert_eq!(host.route(&acme, &[]).unwrap(), local_route("llama-3-8b"));
    }
    assert_eq!(calls_and_reuses(&host, "tenants"), (1, 49));
    // Facts outside the declared set do not matter...
    let mut other_counts = acme.clone();
    other_counts.max_tokens = None;
    other_counts.prompt_tokens = 7;
    other_counts.streaming = true;
    assert_eq!(
        host.route(&other_counts, &[]).unwrap(),
        local_route("llama-3-8b")
    );
    assert_eq!(calls_and_reuses(&host, "tenants"), (1, 50));
    // ...declared ones each get their own call, then their own reuse.
    let globex = tenant_facts("m", Some("globex"), &[]);
    for _ in 0..3 {
        assert_eq!(host.route(&globex, &[]).unwrap(), local_route("qwen"));
    }
    assert_eq!(calls_and_reuses(&host, "tenants"), (2, 52));

    // A new upload replaces the decisions along with the code and config.
    upload_tenants(&host, json!({"tenants": {"acme": {"local": "mistral"}}}));
    assert_eq!(host.route(&acme, &[]).unwrap(), local_route("mistral"));
    assert_eq!(calls_and_reuses(&host, "tenants"), (3, 52));

    // The declaration is stored with the policy: after a restart the
    // decisions are reused without asking the guest again.
    drop(host);
    let host = common::host(dir.path());
    assert_eq!(
        host.get("tenants").unwrap().decision_inputs,
        info.decision_inputs
    );
    for _ in 0..3 {
        assert_eq!(host.route(&acme, &[]).unwrap(), local_route("mistral"));
    }
    assert_eq!(calls_and_reuses(&host, "tenants"), (1, 2));

    // A router that declares nothing is called for every request.
    host.bind(PolicyKind::Router, "alias").unwrap();
    let backends = [local("m", 0, 0)];
    for _ in 0..3 {
        assert_eq!(host.route(&acme, &backends).unwrap(), local_route("m"));
    }
    assert_eq!(calls_and_reuses(&host, "alias"), (3, 0));
}

#[test]
fn alias_router_bad_config_is_refused_at_upload() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let err = host
        .upload(
            "alias",
            PolicyKind::Router,
            &wasm("alias-router"),
            opts("{\"alias\": 1}"),
        )
        .unwrap_err();
    assert!(
        matches!(err, PolicyError::InitRejected(ref m) if m.contains("alias-router config")),
        "{err}"
    );
    assert_eq!(common::status(&err), 422);
}

#[test]
fn tenant_router_routes_by_key_tenant_or_header_and_enforces_deny_lists() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let cfg = json!({
        "header": "x-tenant",
        "tenants": {
            "acme": {"local": "llama-3-8b", "deny": ["gpt-4o"]},
            "globex": {"upstream": "openai", "model": "gpt-4o-mini"}
        },
        "unknown": "reject"
    });
    upload(
        &host,
        "tenants",
        PolicyKind::Router,
        "tenant-router",
        &cfg.to_string(),
    );
    let route = |f| host.route_with("tenants", &f, &[]).unwrap();

    assert_eq!(
        route(tenant_facts("anything", Some("acme"), &[])),
        local_route("llama-3-8b")
    );
    assert_eq!(
        route(tenant_facts("m", None, &[("X-Tenant", "globex")])),
        RouteDecision::Upstream {
            name: "openai".into(),
            model: Some("gpt-4o-mini".into())
        }
    );
    // A key with an empty tenant has none: guests see `None`, so the header
    // decides.
    assert_eq!(
        route(tenant_facts("m", Some(""), &[("x-tenant", "globex")])),
        route(tenant_facts("m", None, &[("x-tenant", "globex")])),
    );
    // The key's tenant wins over a header the client controls.
    assert_eq!(
        route(tenant_facts("m", Some("acme"), &[("x-tenant", "globex")])),
        local_route("llama-3-8b")
    );
    assert!(matches!(
        route(tenant_facts("gpt-4o", Some("acme"), &[])),
        RouteDecision::Reject { status: 403, .. }
    ));
    assert!(matches!(
        route(tenant_facts("m", Some("initech"), &[])),
        RouteDecision::Reject { status: 403, .. }
    ));
    assert!(matches!(
        route(facts("m")),
        RouteDecision::Reject { status: 403, .. }
    ));
}

#[test]
fn least_loaded_picks_the_healthy_backend_with_least_load() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    upload(&host, "ll", PolicyKind::Router, "least-loaded", "");
    let route = |b: &[_]| host.route_with("ll", &facts("llama"), b).unwrap();

    let mut down = upstream("cheap", 0, 0);
    down.healthy = false;
    let backends = [
        local("llama", 3, 2),
        upstream("openai", 1, 0),
        down.clone(),
        local("other", 0, 0),
    ];
    assert_eq!(
        route(&backends),
        RouteDecision::Upstream {
            name: "openai".into(),
            model: None
        }
    );
    // Ties go to the local backend.
    assert_eq!(
        route(&[upstream("openai", 2, 0), local("llama", 1, 1)]),
        local_route("llama")
    );
    assert!(matches!(
        route(&[down]),
        RouteDecision::Reject { status: 503, .. }
    ));

    // Configured candidates restrict the choice.
    upload(
        &host,
        "ll2",
        PolicyKind::Router,
        "least-loaded",
        r#"{"candidates": {"llama": ["llama"]}}"#,
    );
    assert_eq!(
        host.route_with(
            "ll2",
            &facts("llama"),
            &[local("llama", 9, 9), upstream("openai", 0, 0)]
        )
        .unwrap(),
        local_route("llama")
    );
}

#[test]
fn adapter_by_tenant_selects_mounted_adapters_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let cfg = json!({"tenants": {"acme": ["acme-tone", "acme-sql", "acme-missing"]}});
    upload(
        &host,
        "abt",
        PolicyKind::AdapterSelector,
        "adapter-by-tenant",
        &cfg.to_string(),
    );
    let mounted = [
        adapter("acme-sql", "llama"),
        adapter("acme-tone", "llama"),
        adapter("acme-other-base", "qwen"),
    ];
    let sel = |f| host.select_adapters_with("abt", &f, &mounted).unwrap();
    assert_eq!(
        sel(tenant_facts("llama", Some("acme"), &[])),
        Some(vec!["acme-tone".to_string(), "acme-sql".to_string()])
    );
    assert_eq!(sel(tenant_facts("qwen", Some("acme"), &[])), Some(vec![]));
    assert_eq!(sel(tenant_facts("llama", Some("globex"), &[])), None);

    // Through the binding.
    let err = host.select_adapters(&facts("llama"), &mounted).unwrap_err();
    assert!(
        matches!(err, PolicyError::NotBound(PolicyKind::AdapterSelector)) && err.is_fail_open()
    );
    host.bind(PolicyKind::AdapterSelector, "abt").unwrap();
    assert_eq!(
        host.select_adapters(&tenant_facts("llama", Some("acme"), &[]), &mounted)
            .unwrap(),
        Some(vec!["acme-tone".to_string(), "acme-sql".to_string()])
    );
}

fn keep_json(o: &RecordOutcome) -> Value {
    match o {
        RecordOutcome::Keep(s) => serde_json::from_str(s).unwrap(),
        other => panic!("expected keep, got {other:?}"),
    }
}

#[test]
fn alpaca_to_chat_converts_records() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    upload(
        &host,
        "a2c",
        PolicyKind::DatasetTransform,
        "alpaca-to-chat",
        r#"{"system": "Be brief."}"#,
    );
    let records = vec![
        json!({"instruction": "Add", "input": "2 and 3", "output": "5"}).to_string(),
        json!({"instruction": "Say hi", "input": "", "output": "hi"}).to_string(),
        json!({"instruction": "No output"}).to_string(),
        "{not json".to_string(),
    ];
    let out = host.transform_batch("a2c", &records).unwrap();
    assert_eq!(out.len(), 4);
    assert_eq!(
        keep_json(&out[0]),
        json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add\n\n2 and 3"},
            {"role": "assistant", "content": "5"}
        ]})
    );
    assert_eq!(
        keep_json(&out[1])["messages"][1],
        json!({"role": "user", "content": "Say hi"})
    );
    assert!(
        matches!(&out[2], RecordOutcome::Error(m) if m.contains("output")),
        "{:?}",
        out[2]
    );
    assert!(matches!(&out[3], RecordOutcome::Error(m) if m.contains("invalid JSON")));
}

#[test]
fn dataset_clean_normalises_and_drops() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    upload(
        &host,
        "clean",
        PolicyKind::DatasetTransform,
        "dataset-clean",
        r#"{"max_chars": 40}"#,
    );
    let records = vec![
        json!({"text": "  hello \t  world \r\n\r\n\r\n next  line  "}).to_string(),
        json!({"text": "   ", "other": ["", " \n "]}).to_string(),
        json!({"text": "x".repeat(41)}).to_string(),
        json!({"text": "bad \u{FFFD} bytes"}).to_string(),
        r#"{"text": "lone \ud800 surrogate"}"#.to_string(),
        "[1, 2".to_string(),
    ];
    let out = host.transform_batch("clean", &records).unwrap();
    assert_eq!(
        keep_json(&out[0]),
        json!({"text": "hello world\n\nnext line"})
    );
    assert_eq!(out[1], RecordOutcome::Drop("empty".into()));
    assert!(matches!(&out[2], RecordOutcome::Drop(m) if m.starts_with("oversized")));
    assert_eq!(out[3], RecordOutcome::Drop("non-utf8".into()));
    assert_eq!(out[4], RecordOutcome::Drop("non-utf8".into()));
    assert!(matches!(&out[5], RecordOutcome::Error(_)));
}

#[test]
fn bound_router_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let err = host.route(&facts("m"), &[]).unwrap_err();
    assert!(err.is_fail_open(), "nothing bound means default route");
    upload(&host, "alias", PolicyKind::Router, "alias-router", "");
    host.bind(PolicyKind::Router, "alias").unwrap();
    assert_eq!(host.binding(PolicyKind::Router).as_deref(), Some("alias"));
    for _ in 0..10 {
        assert_eq!(
            host.route(&facts("llama"), &[local("llama", 0, 0)])
                .unwrap(),
            local_route("llama")
        );
    }
    let m = host.metrics();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].calls, 10, "probe call at upload is not counted");
    assert_eq!(m[0].instances_created, 1, "one warm instance reused");
    assert_eq!(m[0].latency_buckets.last().unwrap().1, 10);
    let text = mlxgate::policy::render_prometheus(&m);
    assert!(
        text.contains("mlxgate_policy_calls_total{policy=\"alias\",kind=\"router\"} 10"),
        "{text}"
    );
    assert!(text.contains(
        "mlxgate_policy_call_duration_seconds_count{policy=\"alias\",kind=\"router\"} 10"
    ));

    // Binding rules.
    upload(
        &host,
        "clean",
        PolicyKind::DatasetTransform,
        "dataset-clean",
        "",
    );
    assert!(matches!(
        host.bind(PolicyKind::Router, "clean"),
        Err(PolicyError::KindMismatch { .. })
    ));
    assert!(matches!(
        host.bind(PolicyKind::DatasetTransform, "clean"),
        Err(PolicyError::NotBindable(_))
    ));
    assert!(matches!(
        host.bind(PolicyKind::Router, "nope"),
        Err(PolicyError::NotFound(_))
    ));
    assert!(matches!(
        host.remove("alias"),
        Err(PolicyError::InUse { .. })
    ));
    host.unbind(PolicyKind::Router).unwrap();
    host.remove("alias").unwrap();
    assert!(matches!(host.get("alias"), Err(PolicyError::NotFound(_))));
    assert_eq!(host.list().len(), 1);
}
