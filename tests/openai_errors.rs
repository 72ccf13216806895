//! Malformed inference requests answer 400 with OpenAI's error JSON naming
//! the offending field, and unknown models 404, before any model is touched
//! (these tests run without a loadable model).

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Server, ServerBuilder};

/// A server whose only model fails to load (the default missing path).
fn server() -> Server {
    let s = ServerBuilder::new().start();
    s.wait_for_status("/readyz", 503, Duration::from_secs(10));
    // Wait until loading has settled (failed), so unknown ids are 404, not 503.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !s.get("/readyz").text().contains("failed to load") {
        assert!(std::time::Instant::now() < deadline, "model never failed");
        std::thread::sleep(Duration::from_millis(25));
    }
    s
}

#[track_caller]
fn expect_400(s: &Server, path: &str, body: Value, param: &str, code: &str) {
    let r = s.post_json(path, &body);
    let e = r.api_error(400, "invalid_request_error", code);
    assert_eq!(e["param"], param, "{body} -> {e}");
}

#[test]
fn malformed_chat_requests_are_400_with_param() {
    let s = server();
    let p = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "hi"}]);
    expect_400(
        &s,
        p,
        json!({"messages": user}),
        "model",
        "missing_required_parameter",
    );
    expect_400(
        &s,
        p,
        json!({"model": 1, "messages": user}),
        "model",
        "invalid_type",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m"}),
        "messages",
        "missing_required_parameter",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": []}),
        "messages",
        "empty_array",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "king", "content": "x"}
        ]}),
        "messages[2].role",
        "invalid_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
        ]}]}),
        "messages[0].content[0].type",
        "unsupported_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "temperature": 2.5}),
        "temperature",
        "decimal_above_max_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "temperature": "warm"}),
        "temperature",
        "invalid_type",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "top_p": 0}),
        "top_p",
        "decimal_below_min_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "n": 9}),
        "n",
        "integer_above_max_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "max_tokens": 0}),
        "max_tokens",
        "integer_below_min_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "stop": ["a", "b", "c", "d", "e"]}),
        "stop",
        "array_above_max_length",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "logit_bias": {"12": 500}}),
        "logit_bias.12",
        "decimal_above_max_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "logprobs": true, "top_logprobs": 21}),
        "top_logprobs",
        "integer_above_max_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "messages": user, "stream_options": {"include_usage": true}}),
        "stream_options",
        "invalid_value",
    );
    // Not JSON at all keeps the generic JSON error.
    s.request("POST", p, &[], Some(b"{\"model\":")).api_error(
        400,
        "invalid_request_error",
        "invalid_json",
    );
}

#[test]
fn malformed_completion_requests_are_400_with_param() {
    let s = server();
    let p = "/v1/completions";
    expect_400(
        &s,
        p,
        json!({"model": "m"}),
        "prompt",
        "missing_required_parameter",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "prompt": ["a", "b"]}),
        "prompt",
        "unsupported_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "prompt": [1, "x"]}),
        "prompt[1]",
        "invalid_type",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "prompt": "a", "logprobs": 6}),
        "logprobs",
        "integer_above_max_value",
    );
    expect_400(
        &s,
        p,
        json!({"model": "m", "prompt": "a", "echo": true}),
        "echo",
        "unsupported_value",
    );
}

#[test]
fn unknown_model_is_404_in_openai_words() {
    let s = server();
    let e = s
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .api_error(404, "not_found_error", "model_not_found");
    assert_eq!(
        e["message"],
        "The model `gpt-17` does not exist or you do not have access to it."
    );
    s.post_json(
        "/v1/completions",
        &json!({"model": "gpt-17", "prompt": "hi"}),
    )
    .api_error(404, "not_found_error", "model_not_found");
}

#[test]
fn aliased_model_that_failed_to_load_is_503_with_the_reason() {
    let s = ServerBuilder::new()
        .config("[[models]]\npath = \"nowhere.gguf\"\nid = \"other\"\n")
        .start();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = s.post_json(
            "/v1/chat/completions",
            &json!({"model": "other", "messages": [{"role": "user", "content": "hi"}]}),
        );
        let e = r.api_error(503, "server_error", "model_not_ready");
        let msg = e["message"].as_str().unwrap_or_default().to_owned();
        if msg.contains("failed to load") {
            assert!(msg.contains("nowhere.gguf"), "{msg}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still not failed: {msg}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    let ready = s.get("/readyz").text();
    assert!(ready.contains("nowhere.gguf"), "{ready}");
}
