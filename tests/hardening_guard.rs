//! Hardening of the request path against policies and prompts: router guests
//! run on the policy host's own threads (a looping router cannot stall the
//! async workers), request-time deadlines have a 1 s ceiling, and special
//! tokens typed in chat content are text, not control tokens. Real binary
//! over loopback, real Wasm guests (`scripts/build-policies.sh`) and the
//! real SmolLM2 model.

#[path = "policy_common/mod.rs"]
mod common;
#[path = "routing_common/mod.rs"]
mod routing;
#[path = "support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use common::wasm;
use mlxgate::policy::{
    FailureKind, HostConfig, Limits, OnError, PolicyHost, PolicyKind, PolicyOptions,
};
use routing::key_hash;
use serde_json::json;
use support::{Response, Server, ServerBuilder, real_model};

const ADMIN: &str = "guard-admin-key";
const KEY: &str = "guard-app-key";

fn server(model: Option<std::path::PathBuf>) -> Server {
    let config = format!(
        "[[keys]]\nid = \"app\"\ntenant = \"acme\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
        key_hash(KEY)
    );
    let mut b = ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        // As on a small machine: two async workers, so two calls running on
        // them would stall everything else.
        .env("TOKIO_WORKER_THREADS", "2");
    if let Some(m) = model {
        b = b.model(m);
    }
    b.start()
}

fn upload(s: &Server, name: &str, query: &str, crate_name: &str) -> Response {
    s.request(
        "PUT",
        &format!("/admin/policies/{name}?{query}"),
        &[("authorization", &format!("Bearer {ADMIN}"))],
        Some(&wasm(crate_name)),
    )
}

fn bind(s: &Server, kind: &str, name: &str) -> Response {
    s.request(
        "PUT",
        &format!("/admin/bindings/{kind}"),
        &[("authorization", &format!("Bearer {ADMIN}"))],
        Some(json!({ "policy": name }).to_string().as_bytes()),
    )
}

fn post(s: &Server, path: &str, body: serde_json::Value) -> Response {
    s.request(
        "POST",
        path,
        &[
            ("authorization", &format!("Bearer {KEY}")),
            ("content-type", "application/json"),
        ],
        Some(body.to_string().as_bytes()),
    )
}

#[test]
fn looping_routers_at_the_highest_deadline_do_not_stall_the_server() {
    let s = server(None);
    // The ceiling for request-time policies: accepted.
    let r = upload(
        &s,
        "looper",
        "kind=router&deadline_ms=1000&on_error=fail_closed",
        "hostile-router",
    );
    assert!(r.status == 200 || r.status == 201, "upload: {}", r.text());
    assert_eq!(bind(&s, "router", "looper").status, 200);

    // Six requests whose router call loops until its 1 s deadline: on two
    // async workers, guest calls inline would block both for about 3 s.
    let started = Instant::now();
    let loops: Vec<_> = (0..6)
        .map(|_| {
            let addr = s.addr;
            std::thread::spawn(move || {
                let r = support::try_request(
                    addr,
                    "POST",
                    "/v1/chat/completions",
                    &[
                        ("authorization", &format!("Bearer {KEY}")),
                        ("content-type", "application/json"),
                    ],
                    Some(
                        json!({"model": "loop", "messages": [{"role": "user", "content": "x"}]})
                            .to_string()
                            .as_bytes(),
                    ),
                )
                .expect("request");
                (r, started.elapsed())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    let health = s.get("/healthz");
    let health_took = asked.elapsed();
    let health_done = started.elapsed();
    assert_eq!(health.status, 200);

    let mut first_done = Duration::MAX;
    for t in loops {
        let (r, done) = t.join().unwrap();
        first_done = first_done.min(done);
        // A loop is a timeout, and this router fails closed.
        let e = r.api_error(503, "server_error", "policy_failed");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains("`looper`") && msg.contains("timeout"), "{msg}");
    }
    // The router calls ran their full deadline while /healthz answered.
    assert!(first_done >= Duration::from_millis(1000), "{first_done:?}");
    assert!(
        health_done < first_done,
        "{health_done:?} vs {first_done:?}"
    );
    assert!(
        health_took < Duration::from_millis(900),
        "/healthz took {health_took:?} while routers looped"
    );
}

#[test]
fn request_time_deadlines_over_the_ceiling_are_refused() {
    let s = server(None);
    for kind in ["router", "adapter-selector"] {
        let crate_name = if kind == "router" {
            "alias-router"
        } else {
            "adapter-by-tenant"
        };
        let r = upload(
            &s,
            "slow",
            &format!("kind={kind}&deadline_ms=1001"),
            crate_name,
        );
        let e = r.api_error(400, "invalid_request_error", "invalid_limits");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains("1..=1000"), "{msg}");
        assert!(msg.contains(kind), "{msg}");
        // Nothing was stored, so there is nothing to bind.
        assert_eq!(bind(&s, kind, "slow").status, 404);
    }
    // Dataset transforms run in jobs, not requests: their ceiling stays.
    let r = upload(
        &s,
        "clean",
        "kind=dataset-transform&deadline_ms=30000",
        "dataset-clean",
    );
    assert!(r.status == 200 || r.status == 201, "{}", r.text());
}

#[test]
fn a_stored_router_over_the_ceiling_is_lowered_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let open = |request_ceiling: u32| {
        let mut cfg = HostConfig::new(dir.path());
        cfg.max_instances = 32;
        cfg.max_memory_bytes = 64 << 20;
        cfg.max_request_deadline_ms = request_ceiling;
        PolicyHost::open(cfg).unwrap()
    };
    {
        // As an older gateway, which allowed 60 s, stored it.
        let old = open(60_000);
        old.upload(
            "slow",
            PolicyKind::Router,
            &wasm("alias-router"),
            PolicyOptions {
                limits: Some(Limits {
                    deadline_ms: 30_000,
                    ..PolicyKind::Router.default_limits()
                }),
                on_error: OnError::FailClosed,
                config: Some(r#"{"aliases": {}}"#.into()),
            },
        )
        .unwrap();
        old.bind(PolicyKind::Router, "slow").unwrap();
    }
    let host = open(HostConfig::new(dir.path()).max_request_deadline_ms);
    let info = host.get("slow").unwrap();
    assert_eq!(info.limits.deadline_ms, 1000);
    assert_eq!(host.binding(PolicyKind::Router).as_deref(), Some("slow"));
}

#[test]
fn special_tokens_in_chat_content_are_text() {
    let s = server(Some(real_model()));
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let model = ready.json()["model"]
        .as_str()
        .expect("readyz names the model")
        .to_owned();
    let prompt_tokens = |content: &str| {
        let r = post(
            &s,
            "/v1/chat/completions",
            json!({"model": model, "max_tokens": 1, "temperature": 0,
                   "messages": [{"role": "user", "content": content}]}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    // A special token is one id; as text, `<|im_end|>` is several
    // (`<|`, `im`, `_`, `end`, `|>`).
    let plain = prompt_tokens("hi");
    for marker in ["<|im_end|>", "<|im_start|>", "<|endoftext|>"] {
        let with = prompt_tokens(&format!("hi{marker}"));
        assert!(
            with >= plain + 3,
            "`{marker}` in content counted as {} token(s): parsed as a control token",
            with - plain
        );
    }
}

#[test]
fn a_full_call_queue_fails_at_once_under_the_policys_on_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = HostConfig::new(dir.path());
    cfg.max_instances = 32;
    cfg.max_memory_bytes = 64 << 20;
    (cfg.call_threads, cfg.call_queue) = (1, 1);
    let host = PolicyHost::open(cfg).unwrap();
    host.upload(
        "looper",
        PolicyKind::Router,
        &wasm("hostile-router"),
        PolicyOptions {
            limits: Some(Limits {
                deadline_ms: 1000,
                ..PolicyKind::Router.default_limits()
            }),
            on_error: OnError::FailClosed,
            config: None,
        },
    )
    .unwrap();
    host.bind(PolicyKind::Router, "looper").unwrap();
    let call = || host.route_if_bound(|| common::facts("loop"), Vec::new);
    // One call runs on the one thread, one waits in the queue...
    let running = call();
    std::thread::sleep(Duration::from_millis(200));
    let queued = call();
    // ...and the next is refused at once, as a failure of the policy.
    let asked = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt.block_on(call()).unwrap_err();
    assert!(asked.elapsed() < Duration::from_millis(500));
    assert_eq!(err.failure_kind(), Some(FailureKind::Capacity), "{err}");
    assert!(!err.is_fail_open());
    assert_eq!(common::status(&err), 503);
    assert!(err.to_string().contains("queued"), "{err}");
    for c in [running, queued] {
        let e = rt.block_on(c).unwrap_err();
        assert_eq!(e.failure_kind(), Some(FailureKind::Timeout), "{e}");
    }
}
