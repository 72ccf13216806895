//! Routing in the request path against the real binary: a bound router
//! policy (real Wasm guests from `scripts/build-policies.sh`) sends requests
//! to a fake upstream on loopback, refuses them, or fails open or closed;
//! upstream failures map to 502/504 in the OpenAI error shape.

#[path = "policy_common/mod.rs"]
mod common;
#[path = "routing_common/mod.rs"]
mod routing;
#[path = "support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::wasm;
use routing::{FIRST_EVENT, FakeUpstream, LAST_EVENT, key_hash, urlencode};
use serde_json::json;
use support::{Response, Server, ServerBuilder, free_port};

const ADMIN: &str = "routing-admin-key";
const TENANTS: [&str; 5] = ["acme", "slowco", "initech", "hooli", "stranger"];

/// The key of no tenant.
const PLAIN_KEY: &str = "key-without-tenant";

fn key(tenant: &str) -> String {
    format!("key-{tenant}")
}

/// A gateway with one key per tenant, upstream `up` (the fake, 1 s timeout,
/// statically serving `static-model`) and upstream `down` (nothing listening).
fn gateway(up: &FakeUpstream) -> Server {
    let mut config = String::new();
    for t in TENANTS {
        config += &format!(
            "[[keys]]\nid = \"{t}-app\"\ntenant = \"{t}\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
            key_hash(&key(t))
        );
    }
    // A key of no tenant, for routers that read a header instead.
    config += &format!(
        "[[keys]]\nid = \"plain-app\"\ntenant = \"\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
        key_hash(PLAIN_KEY)
    );
    config += &format!(
        "[[upstreams]]\nname = \"up\"\nbase_url = \"{}\"\napi_key = \"sk-upstream\"\ntimeout_secs = 1.0\n\
         models = [\"static-model\"]\n\
         [[upstreams]]\nname = \"down\"\nbase_url = \"http://127.0.0.1:{}/v1\"\n",
        up.base_url(),
        free_port()
    );
    ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start()
}

/// Uploads `crate_name` as router `name` with a roomy deadline and binds it.
fn bind_router(s: &Server, name: &str, crate_name: &str, on_error: &str, config: &str) {
    let query = format!(
        "deadline_ms=200&on_error={on_error}&config={}",
        urlencode(config)
    );
    s.bind_router(ADMIN, name, &query, &wasm(crate_name));
}

fn post(s: &Server, tenant: &str, path: &str, body: serde_json::Value) -> Response {
    let key = if tenant.is_empty() {
        PLAIN_KEY.to_owned()
    } else {
        key(tenant)
    };
    let auth = format!("Bearer {key}");
    s.request(
        "POST",
        path,
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        Some(body.to_string().as_bytes()),
    )
}

/// `GET /admin/upstreams`, as a map from name to status.
fn upstream_status(s: &Server, name: &str) -> serde_json::Value {
    let auth = format!("Bearer {ADMIN}");
    let r = s.get_with("/admin/upstreams", &[("authorization", &auth)]);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    v["data"]
        .as_array()
        .and_then(|a| a.iter().find(|u| u["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no upstream {name} in {v}"))
}

fn chat(model: &str) -> serde_json::Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

const TENANT_CONFIG: &str = r#"{"tenants": {
    "acme": {"upstream": "up", "model": "up-model", "deny": ["forbidden"]},
    "slowco": {"upstream": "up"},
    "initech": {"upstream": "down"},
    "hooli": {"upstream": "ghost"}
}, "unknown": "reject"}"#;

/// Every body the gateway would serve is one the router decided on: the
/// routing facts are read by validation's own readers (a whole float such
/// as `8.0` is the integer 8 for both), and a body two parsers could read
/// differently (a repeated key) is refused, never served around the router.
#[test]
fn no_body_is_served_around_the_router() {
    let up = FakeUpstream::start();
    let s = gateway(&up);
    bind_router(&s, "tenants", "tenant-router", "fail_closed", TENANT_CONFIG);
    let path = "/v1/chat/completions";

    let mut denied = chat("forbidden");
    denied["max_tokens"] = json!(8.0);
    post(&s, "acme", path, denied).api_error(403, "permission_error", "policy_rejected");
    let mut denied = json!({"model": "forbidden", "prompt": "hi", "max_tokens": 8.0});
    denied["stream"] = json!(false);
    post(&s, "acme", "/v1/completions", denied).api_error(
        403,
        "permission_error",
        "policy_rejected",
    );

    // Routed as the router said (upstream, model rewritten), not served here.
    let mut routed = chat("gpt-4o");
    routed["max_completion_tokens"] = json!(16.0);
    let r = post(&s, "acme", path, routed);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"], "up-model");

    // A routing field given twice: refused before any policy. A key repeated
    // deeper in a proxied body is the upstream's to read (one served here
    // is refused whole: tests/hardening_requests.rs); the router decides
    // on it either way.
    let auth = format!("Bearer {}", key("acme"));
    let send = |raw: &str| {
        s.request(
            "POST",
            path,
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            Some(raw.as_bytes()),
        )
    };
    let e = send(r#"{"model": "gpt-4o", "model": "forbidden", "messages": [{"role": "user", "content": "hi"}]}"#)
        .api_error(400, "invalid_request_error", "invalid_json");
    assert!(
        e["message"].as_str().unwrap().contains("appears twice"),
        "{e}"
    );
    send(
        r#"{"model": "forbidden", "messages": [{"role": "user", "content": "a", "content": "b"}]}"#,
    )
    .api_error(403, "permission_error", "policy_rejected");
}

/// Routers see what a request asks beyond text in the synthetic
/// `x-mlxgate-features` header (read from the body, never from the client),
/// and tools, tool_choice, response_format and n reach the upstream as sent.
#[test]
fn routers_see_request_features_and_upstreams_get_them_untouched() {
    let up = FakeUpstream::start();
    let s = gateway(&up);
    let config = r#"{"header": "x-mlxgate-features", "tenants": {
        "tools=1,tool_choice=required,response_format=json_object,n=2": {"upstream": "up"},
        "tools=1,tool_choice=auto": {"upstream": "up", "model": "up-model"}
    }, "unknown": "reject"}"#;
    bind_router(&s, "features", "tenant-router", "fail_closed", config);
    let path = "/v1/chat/completions";
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let mut forced = chat("gpt-4o");
    forced["tools"] = tools.clone();
    forced["tool_choice"] = json!("required");
    forced["response_format"] = json!({"type": "json_object"});
    forced["n"] = json!(2);
    let r = post(&s, "", path, forced.clone());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["body"], forced, "passed through as sent");
    // The model rewritten: the body is re-encoded, the fields kept.
    let mut auto = chat("gpt-4o");
    auto["tools"] = tools;
    let r = post(&s, "", path, auto.clone());
    assert_eq!(r.status, 200, "{}", r.text());
    auto["model"] = json!("up-model");
    assert_eq!(r.json()["body"], auto);
    // No features, or features the client claims in a header: refused.
    post(&s, "", path, chat("gpt-4o")).api_error(403, "permission_error", "policy_rejected");
    let auth = format!("Bearer {PLAIN_KEY}");
    let r = s.request(
        "POST",
        path,
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
            ("x-mlxgate-features", "tools=1,tool_choice=auto"),
        ],
        Some(chat("gpt-4o").to_string().as_bytes()),
    );
    assert_eq!(r.status, 403, "{}", r.text());
    // Bad tools are a 400 before any router.
    let mut bad = chat("gpt-4o");
    bad["tool_choice"] = json!("sometimes");
    post(&s, "", path, bad).api_error(400, "invalid_request_error", "invalid_value");
}

#[test]
fn every_openai_path_is_proxied_and_models_list_the_upstreams() {
    let up = FakeUpstream::start();
    let s = gateway(&up);
    // No router: the static route of `static-model` to `up`, on each path.
    let inputs = [
        ("/v1/chat/completions", chat("static-model")),
        (
            "/v1/completions",
            json!({"model": "static-model", "prompt": "hi"}),
        ),
        (
            "/v1/embeddings",
            json!({"model": "static-model", "input": ["a", "b"]}),
        ),
        (
            "/v1/responses",
            json!({"model": "static-model", "input": "hi"}),
        ),
    ];
    for (path, body) in inputs {
        let r = post(&s, "", path, body.clone());
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(r.header("x-mlxgate-upstream"), Some("up"), "{path}");
        assert_eq!(r.json()["path"], path, "{path}");
        assert_eq!(r.json()["body"], body, "{path}: forwarded as sent");
    }
    // Embeddings for a model served nowhere: 404, as elsewhere.
    post(
        &s,
        "",
        "/v1/embeddings",
        json!({"model": "nowhere", "input": "a"}),
    )
    .api_error(404, "not_found_error", "model_not_found");
    // The models list names the upstream's declared models and their owner.
    let auth = format!("Bearer {PLAIN_KEY}");
    let list = s.get_with("/v1/models", &[("authorization", &auth)]).json();
    let entry = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "static-model")
        .cloned()
        .unwrap_or_else(|| panic!("static-model not in {list}"));
    assert_eq!(entry["owned_by"], "up");
    let one = s.get_with("/v1/models/static-model", &[("authorization", &auth)]);
    assert_eq!((one.status, &one.json()), (200, &entry));
}

#[test]
fn streamed_requests_ask_for_usage_unless_the_upstream_refuses_the_field() {
    let up = FakeUpstream::start();
    let body = json!({"model": "echo-stream", "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    for (setting, asked) in [("", true), ("stream_usage = false\n", false)] {
        let config = format!(
            "[[upstreams]]\nname = \"up\"\nbase_url = \"{}\"\nmodels = [\"echo-stream\"]\n{setting}",
            up.base_url()
        );
        let s = ServerBuilder::new().config(&config).start();
        let r = s.post_json("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let text = r.text();
        let event = text
            .lines()
            .find_map(|l| l.strip_prefix("data: {"))
            .unwrap();
        let sent: serde_json::Value = serde_json::from_str(
            serde_json::from_str::<serde_json::Value>(&format!("{{{event}")).unwrap()["choices"][0]
                ["delta"]["content"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            sent["stream_options"]["include_usage"] == true,
            asked,
            "{setting}: {sent}"
        );
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    }
}

#[test]
fn tenant_router_proxies_rejects_and_maps_upstream_failures() {
    let up = FakeUpstream::start();
    let s = gateway(&up);
    bind_router(&s, "tenants", "tenant-router", "fail_closed", TENANT_CONFIG);

    // Proxied with the model rewritten and the upstream's own key.
    let r = post(&s, "acme", "/v1/chat/completions", chat("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["model"], "up-model");
    assert_eq!(v["path"], "/v1/chat/completions");
    assert_eq!(v["authorization"], "Bearer sk-upstream");
    assert_eq!(v["x_request_id"].as_str(), r.header("x-request-id"));
    assert_eq!(r.header("x-mlxgate-upstream"), Some("up"));
    let r = post(
        &s,
        "acme",
        "/v1/completions",
        json!({"model": "gpt-4o", "prompt": "hi"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["path"], "/v1/completions");
    // The tenant router declares its decision inputs (tenant, headers,
    // model), so the second request, on another path, reused the first's
    // decision instead of calling the guest.
    let metrics = s.get("/metrics").text();
    for line in [
        r#"mlxgate_policy_calls_total{policy="tenants",kind="router"} 1"#,
        r#"mlxgate_policy_decisions_reused_total{policy="tenants",kind="router"} 1"#,
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }

    // Routing fields of the wrong type: refused before routing (400).
    let mut bad = chat("gpt-4o");
    bad["stream"] = json!("yes");
    let r = post(&s, "acme", "/v1/chat/completions", bad);
    assert_eq!(r.status, 400, "{}", r.text());

    // The guest's reject: its status and message.
    let e = post(&s, "acme", "/v1/chat/completions", chat("forbidden")).api_error(
        403,
        "permission_error",
        "policy_rejected",
    );
    assert_eq!(
        e["message"],
        "model `forbidden` is not allowed for this tenant"
    );
    let e = post(&s, "stranger", "/v1/chat/completions", chat("m")).api_error(
        403,
        "permission_error",
        "policy_rejected",
    );
    assert_eq!(e["message"], "unknown tenant");

    // Upstream error answers pass through with their status and body.
    let r = post(&s, "slowco", "/v1/chat/completions", chat("status-429"));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limited");

    // Nothing listening: 502; no headers within the 1 s timeout: 504.
    let e = post(&s, "initech", "/v1/chat/completions", chat("m")).api_error(
        502,
        "server_error",
        "upstream_unavailable",
    );
    assert!(e["message"].as_str().unwrap().contains("`down`"), "{e}");
    let started = Instant::now();
    post(&s, "slowco", "/v1/chat/completions", chat("slow")).api_error(
        504,
        "server_error",
        "upstream_timeout",
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "504 after {took:?}"
    );

    // Health as the router sees it: both failed just now.
    let down = upstream_status(&s, "down");
    assert_eq!(down["healthy"], false, "{down}");
    assert!(
        down["last_error"].as_str().unwrap().contains("connect"),
        "{down}"
    );
    let up_status = upstream_status(&s, "up");
    assert_eq!(up_status["healthy"], false, "{up_status}");
    assert_eq!(up_status["in_flight"], 0, "{up_status}");

    // A guest naming an upstream that is not configured.
    post(&s, "hooli", "/v1/chat/completions", chat("m")).api_error(
        502,
        "server_error",
        "unknown_upstream",
    );
}

/// Reads one HTTP/1.1 response head and returns the reader positioned at the body.
fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<String>) {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line).expect("read head");
        if line.trim_end().is_empty() {
            break;
        }
        lines.push(line.trim_end().to_ascii_lowercase());
    }
    let status = lines[0].split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, lines)
}

#[test]
fn streamed_answers_pass_through_incrementally() {
    let up = FakeUpstream::start();
    let s = gateway(&up);
    bind_router(&s, "tenants", "tenant-router", "fail_closed", TENANT_CONFIG);

    let body =
        json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        key("acme"),
        body.len()
    );
    let mut stream = TcpStream::connect(s.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(raw.as_bytes()).unwrap();
    let mut r = BufReader::new(stream);
    let (status, head) = read_head(&mut r);
    assert_eq!(status, 200, "{head:?}");
    assert!(
        head.iter().any(|l| l == "content-type: text/event-stream"),
        "{head:?}"
    );
    assert!(
        head.iter().any(|l| l == "transfer-encoding: chunked"),
        "{head:?}"
    );

    // The first event arrives while the upstream is still holding the rest.
    let mut size = String::new();
    r.read_line(&mut size).unwrap();
    let n = usize::from_str_radix(size.trim(), 16).unwrap();
    let mut chunk = vec![0; n + 2];
    r.read_exact(&mut chunk).unwrap();
    assert_eq!(&chunk[..n], FIRST_EVENT.as_bytes());

    assert_eq!(upstream_status(&s, "up")["in_flight"], 1);
    up.release();
    let mut rest = String::new();
    r.read_to_string(&mut rest).unwrap();
    assert!(rest.contains(LAST_EVENT), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(rest.ends_with("0\r\n\r\n"), "{rest:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream_status(&s, "up")["in_flight"] != 0 {
        assert!(Instant::now() < deadline, "in-flight count not released");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(upstream_status(&s, "up")["healthy"], true);
}

#[test]
fn guest_failures_fail_open_or_closed_and_no_router_stays_local() {
    let up = FakeUpstream::start();
    let s = gateway(&up);
    // The local path: no model is loaded, so a local request ends in the
    // model registry (404/503 model_*), never in routing's codes.
    let local = |r: Response| {
        let v = r.json();
        let code = v["error"]["code"].as_str().unwrap_or_default().to_owned();
        assert!(
            code == "model_not_found" || code == "model_not_ready",
            "not served locally: {} {}",
            r.status,
            r.text()
        );
    };
    local(post(&s, "acme", "/v1/chat/completions", chat("panic")));
    // No router: models listed in `[[upstreams]] models` go there.
    let r = post(&s, "acme", "/v1/chat/completions", chat("static-model"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"], "static-model");
    assert_eq!(r.header("x-mlxgate-upstream"), Some("up"));

    // The hostile router panics on model `panic`.
    bind_router(&s, "closed", "hostile-router", "fail_closed", "");
    let e = post(&s, "acme", "/v1/chat/completions", chat("panic")).api_error(
        503,
        "server_error",
        "policy_failed",
    );
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("`closed`") && msg.contains("fail_closed"),
        "{msg}"
    );
    // Other models pass the same policy and stay local.
    local(post(&s, "acme", "/v1/chat/completions", chat("other")));

    bind_router(&s, "open", "hostile-router", "fail_open", "");
    local(post(&s, "acme", "/v1/chat/completions", chat("panic")));

    // Aliasing: the alias router's 404 for unknown models, with its message.
    bind_router(
        &s,
        "alias",
        "alias-router",
        "fail_closed",
        r#"{"aliases": {}}"#,
    );
    let e = post(&s, "acme", "/v1/chat/completions", chat("gpt-9")).api_error(
        404,
        "not_found_error",
        "policy_rejected",
    );
    assert_eq!(e["message"], "The model `gpt-9` does not exist");
}
