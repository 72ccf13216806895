//! `/v1/prompt_caches` and the `prompt_cache` request field over real HTTP,
//! with the real SmolLM2 model, plus the `mlxgate cache` CLI.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Server, ServerBuilder, real_model, run_cli};

const SYSTEM: &str = "You are a helpful assistant for a small bakery. You answer questions about opening hours, bread, cakes and prices.";

fn post(s: &Server, path: &str, body: &Value) -> support::Response {
    let bytes = serde_json::to_vec(body).unwrap();
    s.request(
        "POST",
        path,
        &[("content-type", "application/json")],
        Some(&bytes),
    )
}

fn chat(model: &str, cache: Option<&str>) -> Value {
    let mut body = json!({
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Do you sell rye bread?"}
        ],
        "temperature": 0,
        "max_tokens": 8
    });
    if let Some(name) = cache {
        body["prompt_cache"] = json!(name);
    }
    body
}

#[test]
fn save_use_list_and_delete_a_prompt_cache() {
    // No memory tier: what is reused comes from the file.
    let s = ServerBuilder::new()
        .model(real_model())
        .config("[prompt_cache]\nmemory_mb = 0\n")
        .start();
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let model = ready.json()["model"].as_str().unwrap().to_owned();

    let saved = post(
        &s,
        "/v1/prompt_caches",
        &json!({"name": "bakery", "model": model, "messages": [{"role": "system", "content": SYSTEM}]}),
    );
    assert_eq!(saved.status, 201, "{}", saved.text());
    let saved = saved.json();
    assert_eq!(saved["object"], "prompt_cache");
    let cached = saved["tokens"].as_u64().unwrap();
    assert!(cached > 20, "{saved}");
    assert!(saved["bytes"].as_u64().unwrap() > 16 * 1024);

    let url = format!("http://{}", s.addr);
    let (status, out, err) = run_cli(&["cache", "list", "--url", &url], &[]);
    assert!(status.success(), "{err}");
    assert!(out.contains("\"bakery\""), "{out}");

    let with = post(&s, "/v1/chat/completions", &chat(&model, Some("bakery")));
    assert_eq!(with.status, 200, "{}", with.text());
    let with = with.json();
    assert_eq!(
        with["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );
    let without = post(&s, "/v1/chat/completions", &chat(&model, None)).json();
    assert_eq!(
        with["choices"][0]["message"]["content"],
        without["choices"][0]["message"]["content"]
    );

    // Bad references and bad saves get OpenAI-shaped errors.
    let e = post(&s, "/v1/chat/completions", &chat(&model, Some("missing"))).api_error(
        400,
        "invalid_request_error",
        "prompt_cache_not_found",
    );
    assert_eq!(e["param"], "prompt_cache");
    post(&s, "/v1/chat/completions", &chat(&model, Some("../etc"))).api_error(
        400,
        "invalid_request_error",
        "invalid_value",
    );
    let mut wrong_type = chat(&model, None);
    wrong_type["prompt_cache"] = json!(5);
    post(&s, "/v1/chat/completions", &wrong_type).api_error(
        400,
        "invalid_request_error",
        "invalid_type",
    );
    post(
        &s,
        "/v1/prompt_caches",
        &json!({"model": model, "prompt": "x"}),
    )
    .api_error(400, "invalid_request_error", "missing_required_parameter");
    post(
        &s,
        "/v1/prompt_caches",
        &json!({"name": "two", "model": model, "prompt": "x", "messages": []}),
    )
    .api_error(400, "invalid_request_error", "invalid_value");
    post(
        &s,
        "/v1/prompt_caches",
        &json!({"name": "x", "model": "nope", "prompt": "x"}),
    )
    .api_error(404, "not_found_error", "model_not_found");

    let one = s.get("/v1/prompt_caches/bakery");
    assert_eq!(one.status, 200);
    assert_eq!(one.json()["tokens"], cached);
    let metrics = s.get("/metrics").text();
    assert!(
        metrics.contains(&format!(
            "mlxgate_prompt_cache_lookups_total{{model=\"{model}\",result=\"disk_hit\"}} 1"
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("mlxgate_prompt_cache_files{} 1"),
        "{metrics}"
    );

    let (status, _, err) = run_cli(&["cache", "rm", "bakery", "--url", &url], &[]);
    assert!(status.success(), "{err}");
    s.request("DELETE", "/v1/prompt_caches/bakery", &[], None)
        .api_error(404, "not_found_error", "prompt_cache_not_found");
    s.get("/v1/prompt_caches/bakery")
        .api_error(404, "not_found_error", "prompt_cache_not_found");
}
