//! Anthropic's Messages API over real HTTP: `tests/anthropic_messages.py`
//! drives the official `anthropic` Python package against the real model
//! (text and usage, the streamed event grammar, a tool round trip,
//! `count_tokens`, bad input); the gateway's own errors on these paths
//! (auth) in Anthropic's shape; keys by `x-api-key`; a router policy
//! sending a Messages (and a Responses) request to an upstream, which gets
//! it as sent.

#[path = "policy_common/mod.rs"]
mod common;
#[path = "routing_common/mod.rs"]
mod routing;
mod support;

use std::time::Duration;

use routing::{FakeUpstream, key_hash, urlencode};
use serde_json::json;
use support::{ServerBuilder, real_model, run_sdk_script};

#[test]
fn the_anthropic_sdk_gets_messages_streams_tools_and_errors() {
    let s = ServerBuilder::new().model(real_model()).start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let out = run_sdk_script(
        &s,
        "anthropic_messages.py",
        "anthropic",
        &["SmolLM2-135M-Instruct"],
    );
    assert!(out.contains("tool_round_trip: ok"), "{out}");
}

const KEY: &str = "key-anthropic-client";
const OTHER_KEY: &str = "key-anthropic-other";
const ADMIN: &str = "admin-key-anthropic";

/// Keys travel as `x-api-key` or `Authorization: Bearer`; a bad one is a
/// 401 in Anthropic's shape on Messages paths (OpenAI's elsewhere).
#[test]
fn keys_by_x_api_key_and_errors_in_anthropic_shape() {
    let config = format!(
        "[[keys]]\nid = \"client\"\ntenant = \"acme\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
        key_hash(KEY)
    );
    let s = ServerBuilder::new()
        .model(real_model())
        .config(&config)
        .start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let body = json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();
    let post = |path: &str, headers: &[(&str, &str)]| {
        let mut all = vec![
            ("content-type", "application/json"),
            ("anthropic-version", "2023-06-01"),
        ];
        all.extend_from_slice(headers);
        s.request("POST", path, &all, Some(body.as_bytes()))
    };
    let bearer = format!("Bearer {KEY}");
    for headers in [
        vec![("x-api-key", KEY)],
        vec![("authorization", bearer.as_str())],
    ] {
        let r = post("/v1/messages", &headers);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["type"], "message");
    }
    for headers in [vec![("x-api-key", "wrong")], vec![]] {
        let r = post("/v1/messages", &headers);
        assert_eq!(r.status, 401, "{}", r.text());
        let v = r.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
    }
    // The same key on the OpenAI paths; errors there keep OpenAI's shape.
    let r = post("/v1/chat/completions", &[("x-api-key", "wrong")]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = post("/v1/messages/count_tokens", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["input_tokens"].as_u64().is_some_and(|n| n > 0));
}

/// A router sees `/v1/messages` (and `/v1/responses`) with its facts and
/// may send them upstream, which receives the client's body (model as the
/// router rewrote it) on the same path.
#[test]
fn routers_send_messages_and_responses_upstream_as_sent() {
    let up = FakeUpstream::start();
    let config = format!(
        "[[keys]]\nid = \"client\"\ntenant = \"acme\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n\
         [[keys]]\nid = \"other\"\ntenant = \"globex\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n\
         [[upstreams]]\nname = \"up\"\nbase_url = \"{}\"\napi_key = \"sk-up\"\nprotocols = [\"openai\", \"anthropic\"]\n\
         [[upstreams]]\nname = \"oa\"\nbase_url = \"{}\"\n",
        key_hash(KEY),
        key_hash(OTHER_KEY),
        up.base_url(),
        up.base_url()
    );
    let s = ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    let router = r#"{"tenants": {"acme": {"upstream": "up", "model": "claude-up"},
                                  "globex": {"upstream": "oa"}}}"#;
    let auth = format!("Bearer {ADMIN}");
    let path = format!(
        "/admin/policies/tenants?kind=router&deadline_ms=200&config={}",
        urlencode(router)
    );
    let r = s.request(
        "PUT",
        &path,
        &[("authorization", &auth)],
        Some(&common::wasm("tenant-router")),
    );
    assert!(r.status == 200 || r.status == 201, "upload: {}", r.text());
    let bind = json!({"policy": "tenants"}).to_string();
    let r = s.request(
        "PUT",
        "/admin/bindings/router",
        &[("authorization", &auth)],
        Some(bind.as_bytes()),
    );
    assert_eq!(r.status, 200, "bind: {}", r.text());

    let sent = json!({"model": "claude-local", "max_tokens": 16, "system": "Be brief.",
                      "messages": [{"role": "user", "content": "Hi"}],
                      "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]});
    let r = s.request(
        "POST",
        "/v1/messages",
        &[("x-api-key", KEY), ("content-type", "application/json")],
        Some(sent.to_string().as_bytes()),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let echo = r.json();
    assert_eq!(echo["path"], "/v1/messages");
    let mut expected = sent.clone();
    expected["model"] = json!("claude-up");
    assert_eq!(echo["body"], expected);
    // Anthropic's way: the upstream's key as x-api-key, a version header;
    // the client's key never leaves.
    assert_eq!(echo["authorization"], json!(null), "{echo}");
    let headers: Vec<&str> = echo["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    assert!(
        headers.contains(&"x-api-key") && headers.contains(&"anthropic-version"),
        "{headers:?}"
    );
    // An upstream that speaks only OpenAI's APIs gets no Messages request.
    let r = s.request(
        "POST",
        "/v1/messages",
        &[
            ("x-api-key", OTHER_KEY),
            ("content-type", "application/json"),
        ],
        Some(sent.to_string().as_bytes()),
    );
    assert_eq!(r.status, 502, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["type"], "api_error", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("protocols"),
        "{e}"
    );
    let sent = json!({"model": "gpt-local", "input": "Hi", "max_output_tokens": 16,
                      "tools": [{"type": "function", "name": "get_weather"}]});
    let r = s.request(
        "POST",
        "/v1/responses",
        &[("x-api-key", KEY), ("content-type", "application/json")],
        Some(sent.to_string().as_bytes()),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let echo = r.json();
    assert_eq!(echo["path"], "/v1/responses");
    let mut expected = sent.clone();
    expected["model"] = json!("claude-up");
    assert_eq!(echo["body"], expected);
    // Bad Messages input is refused before routing, in Anthropic's shape.
    let r = s.request(
        "POST",
        "/v1/messages",
        &[("x-api-key", KEY), ("content-type", "application/json")],
        Some(br#"{"model": "m", "max_tokens": "many", "messages": []}"#),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}
