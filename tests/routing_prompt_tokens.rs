//! Routers see the prompt's true length: the guest SDK README's complete
//! router (`policies/big-to-upstream`, the README's code word for word) is
//! uploaded to a gateway serving the real model, and a prompt goes upstream
//! exactly when its length in tokens, as the local model counts it for its
//! own prefill (`usage.prompt_tokens`), is over the router's threshold.

#[path = "policy_common/mod.rs"]
mod common;
#[path = "routing_common/mod.rs"]
mod routing;
#[path = "support/mod.rs"]
mod support;

use common::wasm;
use routing::{FakeUpstream, urlencode};
use serde_json::{Value, json};
use support::{Response, Server, ServerBuilder, real_model, workspace_root};

const ADMIN: &str = "prompt-tokens-admin";

/// Uploads the README's router with `threshold` and binds it. The deadline
/// is the most a request-time policy may have, and a failure refuses the
/// request: under the default 5 ms a slow call on a loaded machine failed
/// open to the local model, which read as a wrong decision.
fn bind_big_to_upstream(s: &Server, threshold: usize) {
    let query = format!(
        "deadline_ms=1000&on_error=fail_closed&config={}",
        urlencode(&threshold.to_string())
    );
    s.bind_router(ADMIN, "big", &query, &wasm("big-to-upstream"));
}

/// POSTs `body` with the admin key (the only key configured).
fn send(s: &Server, path: &str, body: &Value) -> Response {
    let auth = format!("Bearer {ADMIN}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    s.request("POST", path, &headers, Some(body.to_string().as_bytes()))
}

fn post(s: &Server, path: &str, body: &Value) -> Response {
    let r = send(s, path, body);
    assert_eq!(r.status, 200, "{path}: {}\n{}", r.text(), s.log_text());
    r
}

/// Where an answer came from: the upstream's name, or `None` for local.
fn served_by(r: &Response) -> Option<String> {
    r.header("x-mlxgate-upstream").map(str::to_owned)
}

#[test]
fn the_readme_router_is_the_policy_built_here() {
    let readme = std::fs::read_to_string(workspace_root().join("guest-sdk/README.md")).unwrap();
    let start = readme
        .find("`src/lib.rs`:\n\n```rust\n")
        .expect("README example")
        + 23;
    let code = &readme[start..start + readme[start..].find("```").unwrap()];
    let policy =
        std::fs::read_to_string(workspace_root().join("policies/big-to-upstream/src/lib.rs"))
            .unwrap();
    assert!(
        policy.ends_with(code),
        "policies/big-to-upstream differs from the README"
    );
}

#[test]
fn a_router_sends_prompts_over_its_threshold_upstream_by_the_exact_count() {
    let upstream = FakeUpstream::start();
    let config = format!(
        "[[upstreams]]\nname = \"openai\"\nbase_url = \"{}\"\n",
        upstream.base_url()
    );
    let s = ServerBuilder::new()
        .model(real_model())
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    let ready = s.wait_for_status("/readyz", 200, std::time::Duration::from_secs(120));
    let model = ready.json()["model"].as_str().unwrap().to_owned();
    let chat = |text: &str| {
        json!({"model": model, "max_tokens": 2, "temperature": 0,
               "messages": [{"role": "user", "content": text}]})
    };
    let question = "How many legs does a spider have?";
    // The chat model does not embed: a 400 that says where embeddings go.
    let r = send(
        &s,
        "/v1/embeddings",
        &json!({"model": model, "input": question}),
    );
    let e = r.api_error(400, "invalid_request_error", "model_not_supported");
    assert!(
        e["message"].as_str().unwrap().contains("[[upstreams]]"),
        "{e}"
    );
    let long = question.repeat(40);

    // No router: local, and the model's own count of the prompt.
    let local = post(&s, "/v1/chat/completions", &chat(question));
    assert_eq!(served_by(&local), None);
    let n = local.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(n > 5, "{n}");

    // One token under the count: upstream; at the count: local.
    bind_big_to_upstream(&s, n - 1);
    let r = post(&s, "/v1/chat/completions", &chat(question));
    assert_eq!(served_by(&r).as_deref(), Some("openai"));
    assert_eq!(r.json()["model"], model.as_str(), "forwarded as asked");
    bind_big_to_upstream(&s, n);
    let r = post(&s, "/v1/chat/completions", &chat(question));
    assert_eq!(served_by(&r), None);
    assert_eq!(r.json()["usage"]["prompt_tokens"], n);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        local.json()["choices"][0]["message"]["content"],
        "the counted prompt is the one served"
    );
    let r = post(&s, "/v1/chat/completions", &chat(&long));
    assert_eq!(served_by(&r).as_deref(), Some("openai"));

    // Legacy completions are counted as plain text.
    let completion = |prompt: &str| json!({"model": model, "max_tokens": 2, "prompt": prompt});
    let plain = post(&s, "/v1/completions", &completion(question));
    let m = plain.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(m < n, "no template around plain text: {m} vs {n}");
    bind_big_to_upstream(&s, m - 1);
    let r = post(&s, "/v1/completions", &completion(question));
    assert_eq!(served_by(&r).as_deref(), Some("openai"));
    bind_big_to_upstream(&s, m);
    assert_eq!(
        served_by(&post(&s, "/v1/completions", &completion(question))),
        None
    );

    // A model not served here is estimated from the body's size (4 bytes
    // a token): a short body stays under the threshold, a long one not.
    bind_big_to_upstream(&s, 200);
    let remote = |text: &str| json!({"model": "remote-model", "messages": [{"role": "user", "content": text}]});
    let r = send(&s, "/v1/chat/completions", &remote(question));
    assert_eq!(
        served_by(&r),
        None,
        "estimated under 200: local, which has no such model"
    );
    assert_eq!(r.status, 404, "{}", r.text());
    let r = post(&s, "/v1/chat/completions", &remote(&long));
    assert_eq!(served_by(&r).as_deref(), Some("openai"));
}
