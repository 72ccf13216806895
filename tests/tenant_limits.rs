//! `[limits]` over real HTTP against the real binary and model: requests
//! and tokens per minute refuse exactly the first request past the limit,
//! with `Retry-After` and OpenAI's `x-ratelimit-*` headers; streamed
//! answers count; daily budgets answer `insufficient_quota`; a tenant's
//! concurrency cap holds under 50 parallel requests; `/metrics` counts
//! tokens and latencies; `/admin/usage` survives a restart.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use serde_json::{Value, json};
use support::{Response, Server, ServerBuilder, real_model};

const ADMIN: &str = "limits-admin-key";

/// `[[keys]]`: key `id` of tenant `tenant`, whose secret is `id-secret`.
fn keys(list: &[(&str, &str)]) -> String {
    list.iter()
        .map(|(id, tenant)| {
            format!(
                "[[keys]]\nid = \"{id}\"\ntenant = \"{tenant}\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
                mlxgate::http::auth::KeyHash::of(&secret(id)).to_hex()
            )
        })
        .collect()
}

fn secret(id: &str) -> String {
    format!("{id}-secret")
}

/// A server with the packaged model, and the model's id.
fn server(config: &str, data_dir: Option<&std::path::Path>) -> (Server, String) {
    let mut b = ServerBuilder::new()
        .config(config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .model(real_model());
    if let Some(d) = data_dir {
        b = b.data_dir(d);
    }
    let s = b.start();
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let model = ready.json()["model"].as_str().unwrap().to_owned();
    (s, model)
}

fn call(addr: SocketAddr, key: &str, path: &str, body: &Value) -> Response {
    support::keyed_call(addr, "POST", path, &secret(key), Some(body))
}

/// A completion that costs exactly 15 tokens: 10 prompt token ids and 5
/// generated, with the end-of-text tokens suppressed.
fn fifteen_tokens(model: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "prompt": [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000],
        "max_tokens": 5,
        "temperature": 0,
        "logit_bias": {"0": -100, "1": -100, "2": -100},
        "stream": stream,
        "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
    })
}

fn header_u64(r: &Response, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name} on {} {:?}", r.status, r.headers))
        .parse()
        .unwrap()
}

/// The tokens a finished completion used (whole or streamed).
fn used(r: &Response) -> u64 {
    assert_eq!(r.status, 200, "{}", r.text());
    let usage = if r
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/event-stream"))
    {
        r.text()
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|v| v["usage"].is_object())
            .expect("a usage chunk")["usage"]
            .clone()
    } else {
        r.json()["usage"].clone()
    };
    usage["total_tokens"].as_u64().unwrap()
}

#[test]
fn rates_and_budgets_refuse_exactly_past_the_limit() {
    let config = format!(
        "{}\n[limits.keys.a1]\nrequests_per_minute = 3\n\
         [limits.tenants.a]\nrequests_per_minute = 5\n\
         [limits.tenants.t]\ntokens_per_minute = 40\n\
         [limits.tenants.d]\ndaily_tokens = 20\n\
         [limits.tenants.m]\n[limits.tenants.m.models.other-model]\nrequests_per_minute = 1\n",
        keys(&[
            ("a1", "a"),
            ("a2", "a"),
            ("b1", "b"),
            ("t1", "t"),
            ("d1", "d"),
            ("m1", "m")
        ])
    );
    let (s, model) = server(&config, None);
    let cheap = json!({"model": model, "prompt": "Hi", "max_tokens": 1});

    // Requests per minute: the key's 3, then the tenant's 5 across its keys.
    for left in (0..3).rev() {
        let r = call(s.addr, "a1", "/v1/completions", &cheap);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(header_u64(&r, "x-ratelimit-limit-requests"), 3);
        assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), left);
        assert!(
            r.header("x-ratelimit-reset-requests")
                .unwrap()
                .ends_with('s')
        );
    }
    let r = call(s.addr, "a1", "/v1/completions", &cheap);
    let e = r.api_error(429, "requests", "rate_limit_exceeded");
    assert!(
        e["message"].as_str().unwrap().contains("API key 'a1'"),
        "{e}"
    );
    let wait = header_u64(&r, "retry-after");
    assert!(
        (15..=20).contains(&wait),
        "one request frees every 20 s: {wait}"
    );
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-requests"), 0);
    // The refused request took nothing from the tenant: a2 has 2 left of 5.
    for _ in 0..2 {
        assert_eq!(call(s.addr, "a2", "/v1/completions", &cheap).status, 200);
    }
    let r = call(s.addr, "a2", "/v1/completions", &cheap);
    let e = r.api_error(429, "requests", "rate_limit_exceeded");
    assert!(e["message"].as_str().unwrap().contains("tenant 'a'"), "{e}");
    // Another tenant has no limits: no headers, no refusal.
    let r = call(s.addr, "b1", "/v1/completions", &cheap);
    assert_eq!(r.status, 200);
    assert!(r.header("x-ratelimit-limit-requests").is_none());

    // Tokens per minute, whole and streamed answers alike: 15 + 15 + 15 >
    // 40, so the fourth request is refused (and not the third).
    let mut spent = 0;
    for (i, stream) in [false, true, true].into_iter().enumerate() {
        let r = call(
            s.addr,
            "t1",
            "/v1/completions",
            &fifteen_tokens(&model, stream),
        );
        assert_eq!(header_u64(&r, "x-ratelimit-limit-tokens"), 40);
        let remaining = header_u64(&r, "x-ratelimit-remaining-tokens");
        assert!(
            remaining <= 40 - spent && remaining + 1 >= 40 - spent,
            "request {i}: {remaining} left after {spent}"
        );
        spent += used(&r);
    }
    assert_eq!(spent, 45);
    let r = call(
        s.addr,
        "t1",
        "/v1/completions",
        &fifteen_tokens(&model, false),
    );
    r.api_error(429, "tokens", "rate_limit_exceeded");
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens"), 0);
    let wait = header_u64(&r, "retry-after");
    assert!((5..=10).contains(&wait), "6 tokens at 1.5 s each: {wait}");

    // A daily budget: 15 of 20 used lets one more in; then the quota is out.
    for _ in 0..2 {
        assert_eq!(
            call(
                s.addr,
                "d1",
                "/v1/completions",
                &fifteen_tokens(&model, false)
            )
            .status,
            200
        );
    }
    let r = call(
        s.addr,
        "d1",
        "/v1/completions",
        &fifteen_tokens(&model, false),
    );
    r.api_error(429, "insufficient_quota", "insufficient_quota");
    assert_eq!(header_u64(&r, "x-ratelimit-limit-tokens-day"), 20);
    assert_eq!(header_u64(&r, "x-ratelimit-remaining-tokens-day"), 0);
    assert!(header_u64(&r, "retry-after") <= 86_400);

    // A per-model entry limits that model's requests only.
    let other = json!({"model": "other-model", "prompt": "Hi", "max_tokens": 1});
    assert_eq!(
        call(s.addr, "m1", "/v1/completions", &other).status,
        404,
        "no such model, but counted"
    );
    call(s.addr, "m1", "/v1/completions", &other).api_error(429, "requests", "rate_limit_exceeded");
    assert_eq!(call(s.addr, "m1", "/v1/completions", &cheap).status, 200);
}

#[test]
fn a_tenant_concurrency_cap_holds_under_fifty_parallel_requests() {
    let config = format!(
        "{}\n[limits.tenants.c]\nmax_concurrent_requests = 4\n",
        keys(&[("c1", "c"), ("c2", "c")])
    );
    let (s, model) = server(&config, None);
    let long = json!({
        "model": model, "prompt": "Tell me a long story.", "max_tokens": 200,
        "temperature": 0, "logit_bias": {"0": -100, "1": -100, "2": -100},
    });
    let barrier = Arc::new(Barrier::new(50));
    let threads: Vec<_> = (0..50)
        .map(|i| {
            let (barrier, long, addr) = (Arc::clone(&barrier), long.clone(), s.addr);
            std::thread::spawn(move || {
                barrier.wait();
                call(
                    addr,
                    if i % 2 == 0 { "c1" } else { "c2" },
                    "/v1/completions",
                    &long,
                )
            })
        })
        .collect();
    // While the admitted four generate, the engine's gauges show them.
    let running = format!("mlxgate_model_sequences_running{{model=\"{model}\"}}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let scrape = loop {
        let scrape = s.get("/metrics").text();
        if series(&scrape, &running) == Some(4.0) {
            break scrape;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never 4 running: {scrape}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let kv = format!("mlxgate_model_kv_cache_bytes{{model=\"{model}\"}}");
    assert!(series(&scrape, &kv).unwrap() > 0.0, "{scrape}");
    let answers: Vec<Response> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let served = answers.iter().filter(|r| r.status == 200).count();
    for r in answers.iter().filter(|r| r.status != 200) {
        let e = r.api_error(429, "rate_limit_error", "concurrency_limit_exceeded");
        assert!(e["message"].as_str().unwrap().contains("tenant 'c'"), "{e}");
        assert!(r.header("retry-after").is_some());
    }
    assert_eq!(
        served, 4,
        "all 50 arrive while the first 4 generate 200 tokens each"
    );
    // Every slot came back.
    for _ in 0..4 {
        let short = json!({"model": model, "prompt": "Hi", "max_tokens": 1});
        assert_eq!(call(s.addr, "c1", "/v1/completions", &short).status, 200);
    }
}

/// The value of the series `name{labels}` in a scrape.
fn series(scrape: &str, name_and_labels: &str) -> Option<f64> {
    scrape.lines().find_map(|l| {
        l.strip_prefix(name_and_labels)?
            .strip_prefix(' ')?
            .parse()
            .ok()
    })
}

#[test]
fn tokens_and_latencies_reach_metrics_and_usage_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{}\n[limits.tenants.v]\ndaily_tokens = 1000\n",
        keys(&[("u1", "u"), ("v1", "v")])
    );
    let (mut s, model) = server(&config, Some(dir.path()));
    let chat = json!({
        "model": model, "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 8, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
        "logit_bias": {"0": -100, "1": -100, "2": -100},
    });
    let r = call(s.addr, "u1", "/v1/chat/completions", &chat);
    assert_eq!(r.status, 200);
    let usage: Value = r
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .expect("a usage chunk")["usage"]
        .clone();
    let (prompt, completion) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert_eq!(completion, 8);
    let r = call(
        s.addr,
        "v1",
        "/v1/completions",
        &fifteen_tokens(&model, false),
    );
    assert_eq!(used(&r), 15);

    let scrape = s.get("/metrics").text();
    let labels = format!("tenant=\"u\",model=\"{model}\",backend=\"local\"");
    let tokens = |kind: &str| {
        series(
            &scrape,
            &format!("mlxgate_tokens_total{{{labels},kind=\"{kind}\"}}"),
        )
    };
    assert_eq!(tokens("prompt"), Some(prompt as f64), "{scrape}");
    assert_eq!(tokens("completion"), Some(completion as f64));
    assert_eq!(
        series(&scrape, &format!("mlxgate_requests_total{{{labels}}}")),
        Some(1.0)
    );
    let count = |family: &str| {
        series(
            &scrape,
            &format!("{family}_count{{model=\"{model}\",backend=\"local\"}}"),
        )
        .unwrap_or_else(|| panic!("{family}: {scrape}"))
    };
    for family in ["time_to_first_token", "request_latency", "queue_wait"] {
        assert_eq!(
            count(&format!("mlxgate_{family}_seconds")),
            2.0,
            "{family}: {scrape}"
        );
    }
    // Gaps between tokens: 7 in the chat answer, 4 in the completion.
    assert_eq!(
        count("mlxgate_inter_token_latency_seconds"),
        11.0,
        "{scrape}"
    );

    // The usage ledger, before and after a restart on the same data dir.
    let report = |s: &Server, query: &str| {
        let r = support::keyed_call(s.addr, "GET", &format!("/admin/usage{query}"), ADMIN, None);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let before = report(&s, "?tenant=u");
    assert_eq!(before["totals"]["requests"], 1);
    assert_eq!(before["totals"]["prompt_tokens"], prompt);
    assert_eq!(before["totals"]["completion_tokens"], completion);
    assert_eq!(before["data"][0]["key_id"], "u1");
    assert_eq!(before["data"][0]["backend"], "local");
    s.sigterm();
    s.wait_exit(Duration::from_secs(20));
    let (s, model) = server(&config, Some(dir.path()));
    assert_eq!(report(&s, "?tenant=u")["totals"], before["totals"]);
    // The same report from the command line.
    let url = format!("http://{}", s.addr);
    let (status, out, err) = support::run_cli(
        &["usage", "--tenant", "u", "--url", &url],
        &[("MLXGATE_ADMIN_KEY", ADMIN)],
    );
    assert!(status.success(), "{err}");
    let printed: Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(printed["totals"], before["totals"]);
    assert_eq!(report(&s, "")["totals"]["requests"], 2, "both tenants");
    assert_eq!(
        report(&s, "?from=2000-01-01&to=2000-01-31")["totals"]["requests"],
        0
    );
    let bad = support::keyed_call(s.addr, "GET", "/admin/usage?from=yesterday", ADMIN, None);
    bad.api_error(400, "invalid_request_error", "invalid_request");
    // Inference keys do not read usage.
    let r = support::keyed_call(s.addr, "GET", "/admin/usage", &secret("u1"), None);
    assert_eq!(r.status, 403);
    // The daily budget goes on from what the ledger says was used today.
    let r = call(
        s.addr,
        "v1",
        "/v1/completions",
        &fifteen_tokens(&model, false),
    );
    assert_eq!(
        header_u64(&r, "x-ratelimit-remaining-tokens-day"),
        1000 - 15
    );
}
