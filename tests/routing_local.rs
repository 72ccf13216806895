//! Routing decisions that end on the local engine, against the real SmolLM2
//! model: a `fail_open` router that traps still gets the request served
//! locally, and an aliasing router's `local(model)` is served under the
//! chosen model. Needs `scripts/setup.sh` (model) and
//! `scripts/build-policies.sh` (guests).

#[path = "policy_common/mod.rs"]
mod common;
#[path = "routing_common/mod.rs"]
mod routing;
#[path = "support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use common::wasm;
use routing::urlencode;
use serde_json::json;
use support::{Response, Server, ServerBuilder, real_model};

const ADMIN: &str = "routing-local-admin-key";
const LOAD_TIMEOUT: Duration = Duration::from_secs(120);

fn auth() -> String {
    format!("Bearer {ADMIN}")
}

fn bind_router(s: &Server, name: &str, crate_name: &str, on_error: &str, config: &str) {
    let path = format!(
        "/admin/policies/{name}?kind=router&deadline_ms=200&on_error={on_error}&config={}",
        urlencode(config)
    );
    let r = s.request(
        "PUT",
        &path,
        &[("authorization", &auth())],
        Some(&wasm(crate_name)),
    );
    assert!(r.status == 200 || r.status == 201, "upload: {}", r.text());
    let body = json!({ "policy": name }).to_string();
    let r = s.request(
        "PUT",
        "/admin/bindings/router",
        &[("authorization", &auth())],
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 200, "bind: {}", r.text());
}

/// Waits until `/v1/models` lists the model `id` (it loads in the background).
fn wait_for_model(s: &Server, id: &str) {
    let deadline = Instant::now() + LOAD_TIMEOUT;
    let listed = format!("\"{id}\"");
    while !s
        .get_with("/v1/models", &[("authorization", &auth())])
        .text()
        .contains(&listed)
    {
        assert!(
            Instant::now() < deadline,
            "model did not load; log:\n{}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn chat(s: &Server, model: &str) -> Response {
    let body = json!({"model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi"}]})
    .to_string();
    s.request(
        "POST",
        "/v1/chat/completions",
        &[
            ("authorization", &auth()),
            ("content-type", "application/json"),
        ],
        Some(body.as_bytes()),
    )
}

#[track_caller]
fn served_locally_as(r: &Response, model: &str) {
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mlxgate-upstream"), None);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert_eq!(v["model"], model, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
}

#[test]
fn fail_open_and_local_decisions_are_served_by_the_engine() {
    let model = real_model();
    assert!(
        model.is_file(),
        "{} is missing: run scripts/setup.sh",
        model.display()
    );
    // The real model under the id `panic`, the model the hostile router traps on.
    let s = ServerBuilder::new()
        .config(&format!(
            "[[models]]\npath = \"{}\"\nid = \"panic\"\n",
            model.display()
        ))
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    wait_for_model(&s, "panic");

    bind_router(&s, "open", "hostile-router", "fail_open", "");
    served_locally_as(&chat(&s, "panic"), "panic");
    assert!(s.log_text().contains("fail_open"), "the failure is logged");

    bind_router(&s, "closed", "hostile-router", "fail_closed", "");
    assert_eq!(chat(&s, "panic").status, 503);

    bind_router(
        &s,
        "alias",
        "alias-router",
        "fail_closed",
        r#"{"aliases": {"gpt-4o": "panic"}}"#,
    );
    served_locally_as(&chat(&s, "gpt-4o"), "panic");
}

/// `policies/quota-spillover`: a caller whose local budget for a model is
/// spent is sent upstream (whose model has no entry of its own) instead of
/// being refused; the router reads `caller-quota.remaining`.
#[test]
fn a_router_sends_a_caller_over_its_local_budget_upstream() {
    let up = routing::FakeUpstream::start();
    let key = "routing-local-spill-key";
    let config = format!(
        "[[models]]\npath = \"{}\"\nid = \"smol\"\n\
         [[keys]]\nid = \"s1\"\ntenant = \"s\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n\
         [[upstreams]]\nname = \"spill\"\nbase_url = \"{}\"\n\
         [limits.tenants.s.models.smol]\nrequests_per_minute = 2\n",
        real_model().display(),
        routing::key_hash(key),
        up.base_url()
    );
    let s = ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    wait_for_model(&s, "smol");
    bind_router(
        &s,
        "spill",
        "quota-spillover",
        "fail_closed",
        r#"{"upstream": "spill", "model": "spill-model"}"#,
    );
    let ask = || {
        let body = json!({"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]});
        support::keyed_call(s.addr, "POST", "/v1/chat/completions", key, Some(&body))
    };
    for left in ["1", "0"] {
        let r = ask();
        served_locally_as(&r, "smol");
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some(left));
    }
    // Spent: upstream, under the upstream's model, which no limit names.
    let r = ask();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mlxgate-upstream"), Some("spill"));
    assert_eq!(r.json()["body"]["model"], "spill-model");
    assert_eq!(r.header("x-ratelimit-remaining-requests"), None);
    // Metered under the backend that answered, with the upstream's usage.
    let scrape = s.get("/metrics").text();
    let labels = "tenant=\"s\",model=\"spill-model\",backend=\"spill\"";
    assert!(
        scrape.contains(&format!("mlxgate_requests_total{{{labels}}} 1")),
        "{scrape}"
    );
    assert!(
        scrape.contains(&format!(
            "mlxgate_tokens_total{{{labels},kind=\"prompt\"}} 7"
        )),
        "{scrape}"
    );
    assert!(
        scrape.contains(&format!(
            "mlxgate_tokens_total{{{labels},kind=\"completion\"}} 2"
        )),
        "{scrape}"
    );
}
