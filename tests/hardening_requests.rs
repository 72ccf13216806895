//! Per-request amplifiers are capped before they cost anything: adapter
//! stacks, stop strings, model names, `logit_bias`, and prompt text that
//! cannot fit the context (refused before it is tokenized). Each answer is a
//! 400 in OpenAI's shape naming the field.

mod support;

use serde_json::{Value, json};
use support::Server;

/// Asserts a 400 naming `param` with `code`; returns the message.
#[track_caller]
fn expect_400(s: &Server, body: Value, param: &str, code: &str) -> String {
    let r = s.post_json("/v1/chat/completions", &body);
    let e = r.api_error(400, "invalid_request_error", code);
    assert_eq!(e["param"], param, "{e}");
    e["message"].as_str().unwrap_or_default().to_owned()
}

fn chat(model: &str, extra: Value) -> Value {
    let mut v = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    if let (Value::Object(base), Value::Object(extra)) = (&mut v, extra) {
        base.extend(extra);
    }
    v
}

/// The real model, loaded (each check below must answer before the model
/// does any work, even though it could), and its id.
fn server() -> (Server, String) {
    support::model_server("")
}

#[test]
fn amplifiers_are_capped_with_a_400_naming_the_field() {
    let (s, m) = server();

    // Adapter stacks: no repeats (200,000 copies of one id) and at most 64.
    let message = expect_400(
        &s,
        chat(&m, json!({"adapter": vec!["a"; 200_000].join("+")})),
        "adapter",
        "invalid_value",
    );
    assert!(message.contains("twice"), "{message}");
    let many: Vec<String> = (0..65).map(|i| format!("a{i}")).collect();
    let message = expect_400(
        &s,
        chat(&m, json!({"adapter": many.join("+")})),
        "adapter",
        "invalid_value",
    );
    assert!(message.contains("at most 64"), "{message}");
    let r = s.request(
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json"), ("x-adapter", "b,b")],
        Some(chat(&m, json!({})).to_string().as_bytes()),
    );
    let e = r.api_error(400, "invalid_request_error", "invalid_value");
    assert_eq!(e["param"], "X-Adapter", "{e}");

    // Stop strings: by length, whether alone or in an array.
    let long = "x".repeat(1 << 20);
    expect_400(
        &s,
        chat(&m, json!({"stop": long})),
        "stop",
        "string_above_max_length",
    );
    expect_400(
        &s,
        chat(&m, json!({"stop": ["ok", "x".repeat(257)]})),
        "stop[1]",
        "string_above_max_length",
    );

    // Model names: they are routing facts that policies keep.
    expect_400(
        &s,
        chat(&m, json!({"model": "m".repeat(300)})),
        "model",
        "string_above_max_length",
    );

    // logit_bias: at most 300 entries.
    let bias: serde_json::Map<String, Value> =
        (0..301).map(|i| (i.to_string(), json!(1))).collect();
    expect_400(
        &s,
        chat(&m, json!({"logit_bias": bias})),
        "logit_bias",
        "object_above_max_properties",
    );

    // A body served here that repeats a key, at any depth: refused whole.
    let r = s.request(
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(
            format!(r#"{{"model": "{m}", "messages": [{{"role": "user", "content": "a", "content": "b"}}]}}"#)
                .as_bytes(),
        ),
    );
    let e = r.api_error(400, "invalid_request_error", "invalid_json");
    assert!(
        e["message"].as_str().unwrap().contains("appears twice"),
        "{e}"
    );

    // The model still serves after all of that.
    let r = s.post_json(
        "/v1/chat/completions",
        &chat(&m, json!({"max_tokens": 2, "stop": ["x".repeat(256)]})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn prompt_text_that_cannot_fit_is_refused_before_tokenizing() {
    let (s, m) = server();
    // 3.5 MB of text: more than the context (8192 tokens) times the
    // longest vocabulary entry, so it cannot fit whatever it tokenizes to.
    let text = "lorem ipsum dolor sit amet ".repeat(130_000);
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            chat(&m, json!({"messages": [{"role": "user", "content": text}]})),
            "messages",
        ),
        (
            "/v1/completions",
            json!({"model": m, "prompt": text}),
            "prompt",
        ),
    ] {
        let r = s.post_json(path, &body);
        let e = r.api_error(400, "invalid_request_error", "context_length_exceeded");
        assert_eq!(e["param"], param, "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(message.contains("refused before tokenizing"), "{message}");
    }
    // A prompt that fits is still served.
    let r = s.post_json(
        "/v1/completions",
        &json!({"model": m, "prompt": "Once", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}
