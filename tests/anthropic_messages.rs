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
const THIRD_KEY: &str = "key-anthropic-third";
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
         [[keys]]\nid = \"third\"\ntenant = \"initech\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n\
         [[upstreams]]\nname = \"oa\"\nbase_url = \"{}\"\n\
         [[upstreams]]\nname = \"an\"\nbase_url = \"{}\"\nprotocols = [\"anthropic\"]\n",
        key_hash(KEY),
        key_hash(OTHER_KEY),
        up.base_url(),
        key_hash(THIRD_KEY),
        up.base_url(),
        up.base_url()
    );
    let s = ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    let router = r#"{"tenants": {"acme": {"upstream": "up", "model": "claude-up"},
                                  "globex": {"upstream": "oa", "model": "echo-body"},
                                  "initech": {"upstream": "an"}}}"#;
    let query = format!("deadline_ms=200&config={}", urlencode(router));
    s.bind_router(ADMIN, "tenants", &query, &common::wasm("tenant-router"));

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
    // An upstream that speaks only OpenAI's APIs gets the Messages request
    // as a chat completion, and the client gets Anthropic's message.
    let post_other = |body: &serde_json::Value| {
        s.request(
            "POST",
            "/v1/messages",
            &[
                ("x-api-key", OTHER_KEY),
                ("content-type", "application/json"),
            ],
            Some(body.to_string().as_bytes()),
        )
    };
    let mut turn = sent.clone();
    turn["messages"] = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}
    ]);
    turn["stop_sequences"] = json!(["END"]);
    let r = post_other(&turn);
    assert_eq!(r.status, 200, "{}", r.text());
    let m = r.json();
    assert_eq!(m["type"], "message", "{m}");
    assert_eq!(m["stop_reason"], "end_turn", "{m}");
    assert_eq!(m["usage"]["input_tokens"], 7, "{m}");
    let chat: serde_json::Value =
        serde_json::from_str(m["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(chat["model"], "echo-body");
    assert_eq!(chat["stop"], json!(["END"]));
    assert_eq!(
        chat["tools"][0]["function"]["name"], "get_weather",
        "{chat}"
    );
    let roles: Vec<&str> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"], "{chat}");
    assert_eq!(
        chat["messages"][2]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Paris\"}"
    );
    assert_eq!(chat["messages"][3]["tool_call_id"], "toolu_1");
    // The translated answer's usage is counted under the upstream that gave it.
    let scrape = s.get("/metrics").text();
    let counted = "mlxgate_tokens_total{tenant=\"globex\",model=\"echo-body\",backend=\"oa\",kind=\"prompt\"} 7";
    assert!(scrape.contains(counted), "{scrape}");
    // Streamed: the upstream's chunks as Anthropic's events.
    up.release();
    let mut streamed = sent.clone();
    streamed["stream"] = json!(true);
    let r = post_other(&streamed);
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    let kinds: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(
        kinds,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ],
        "{text}"
    );
    assert!(
        text.contains("\"text\":\"first\"") && text.contains("\"text\":\"last\""),
        "{text}"
    );
    // An upstream that speaks only Anthropic's API gets no chat request.
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]});
    let r = s.request(
        "POST",
        "/v1/chat/completions",
        &[
            ("x-api-key", THIRD_KEY),
            ("content-type", "application/json"),
        ],
        Some(chat.to_string().as_bytes()),
    );
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_protocol_mismatch");
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
