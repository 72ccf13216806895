//! Serving under load, on the packaged SmolLM2: a long prompt is prefilled
//! in chunks between the running streams' decode steps (they keep getting
//! tokens), sequences preempted for KV memory are recomputed and finish with
//! the same tokens, the queue is bounded (503 `overloaded` / 429 with
//! `Retry-After`, never a hang, and the server serves normally after), one
//! tenant's flood does not starve another, and a router policy's priority
//! class goes ahead of fairness. Every greedy output under load equals the
//! same request served alone.

#[path = "policy_common/mod.rs"]
mod policy;
mod support;

use std::time::{Duration, Instant};

use mlxgate::engine::{
    EngineError, EngineHandle, EngineOptions, GenerateEvent, GenerateRequest, GenerationStream,
    Prompt, SchedulingOptions,
};
use serde_json::{Value, json};
use support::{ServerBuilder, real_model};

/// SmolLM2's end-of-sequence ids, suppressed so every run decodes to
/// `max_tokens`.
const EOS: [u32; 2] = [0, 2];

fn request(prompt: &str, max_tokens: usize) -> GenerateRequest {
    GenerateRequest::greedy(Prompt::Text(prompt.into()), max_tokens).suppressing(&EOS)
}

/// An engine with these scheduling options and no in-memory prompt cache
/// (each request's reference run alone would otherwise leave its prompt
/// cached, and the run under load would skip the prefill it is about).
fn engine(scheduling: SchedulingOptions) -> EngineHandle {
    let mut options = EngineOptions {
        scheduling,
        ..EngineOptions::default()
    };
    options.prompt_cache.memory_bytes = 0;
    EngineHandle::load_with(&real_model(), options).expect("load SmolLM2 (run scripts/setup.sh)")
}

/// A stream's text and when each piece of it arrived.
struct Received {
    text: String,
    at: Vec<Instant>,
    tokens: usize,
}

fn receive(mut stream: GenerationStream) -> Received {
    let mut received = Received {
        text: String::new(),
        at: Vec::new(),
        tokens: 0,
    };
    while let Some(event) = stream.blocking_next() {
        match event.expect("event") {
            GenerateEvent::Delta { text, .. } => {
                received.text += &text;
                received.at.push(Instant::now());
            }
            GenerateEvent::Finished { usage, .. } => {
                received.tokens = usage.completion_tokens;
                return received;
            }
        }
    }
    panic!("the stream ended without finishing");
}

fn alone(engine: &EngineHandle, request: GenerateRequest) -> String {
    receive(engine.generate(request).unwrap()).text
}

/// ~2,000 tokens of varied text.
fn document() -> String {
    (0..110)
        .map(|i| {
            format!(
                "Note {i}: the keeper logged {} ships and {} gulls. ",
                i * 3 % 17,
                i % 7
            )
        })
        .collect()
}

#[test]
fn a_long_prompt_is_prefilled_between_decode_steps_and_changes_no_token() {
    let engine = engine(SchedulingOptions {
        prefill_chunk: 64,
        ..SchedulingOptions::default()
    });
    let chats: Vec<GenerateRequest> = (0..4)
        .map(|i| request(&format!("Tell story number {i} about a lighthouse."), 160))
        .collect();
    let long = request(&document(), 8);
    let expected: Vec<String> = chats.iter().map(|r| alone(&engine, r.clone())).collect();
    let expected_long = alone(&engine, long.clone());

    let mut streams: Vec<GenerationStream> = chats
        .iter()
        .map(|r| engine.generate(r.clone()).unwrap())
        .collect();
    // Each stream is decoding before the long prompt arrives.
    let firsts: Vec<String> = streams
        .iter_mut()
        .map(|s| match s.blocking_next() {
            Some(Ok(GenerateEvent::Delta { text, .. })) => text,
            other => panic!("expected a first token, got {other:?}"),
        })
        .collect();
    let handles: Vec<_> = streams
        .into_iter()
        .map(|s| std::thread::spawn(move || receive(s)))
        .collect();
    let sent = Instant::now();
    let long_stream = receive(engine.generate(long).unwrap());
    let long_first = long_stream.at[0];
    let results: Vec<Received> = handles.into_iter().map(|h| h.join().unwrap()).collect();

    let prompt_tokens = engine.tokenize(&document()).unwrap().len();
    assert!(prompt_tokens > 1000, "{prompt_tokens} tokens");
    for (i, got) in results.iter().enumerate() {
        let during = got
            .at
            .iter()
            .filter(|&&t| t > sent && t < long_first)
            .count();
        // ~prompt / 64 chunks, a decode step beside each; all at once
        // would give none.
        assert!(
            during >= 8,
            "stream {i} got {during} tokens while {prompt_tokens} prompt tokens were prefilled"
        );
        assert_eq!(
            firsts[i].clone() + &got.text,
            expected[i],
            "stream {i} changed under load"
        );
    }
    assert_eq!(long_stream.text, expected_long);
}

#[test]
fn sequences_preempted_for_kv_memory_are_recomputed_and_finish_with_the_same_tokens() {
    // SmolLM2 keeps 46,080 bytes of KV per token: 4 sequences of ~140
    // tokens need ~26 MB, twice this budget.
    let engine = engine(SchedulingOptions {
        kv_cache_bytes: 13 << 20,
        ..SchedulingOptions::default()
    });
    let requests: Vec<GenerateRequest> = (0..4)
        .map(|i| request(&format!("Write a poem number {i} about the sea."), 120))
        .collect();
    let expected: Vec<String> = requests.iter().map(|r| alone(&engine, r.clone())).collect();
    assert_eq!(engine.queue_stats().preempted, 0);
    let handles: Vec<_> = requests
        .iter()
        .map(|r| {
            let stream = engine.generate(r.clone()).unwrap();
            std::thread::spawn(move || receive(stream))
        })
        .collect();
    for (i, handle) in handles.into_iter().enumerate() {
        let got = handle.join().unwrap();
        assert_eq!(got.tokens, 120, "sequence {i} finished early");
        assert_eq!(got.text, expected[i], "sequence {i} changed by preemption");
    }
    assert!(engine.queue_stats().preempted > 0, "nothing was preempted");
}

#[test]
fn a_full_queue_refuses_at_once_with_a_wait_and_frees_places_as_requests_start_or_leave() {
    let engine = engine(SchedulingOptions {
        max_batch: 1,
        max_queued: 2,
        tenant_queue_share: 1.0,
        ..SchedulingOptions::default()
    });
    let mut running = engine
        .generate(request("Count to a thousand:", 400))
        .unwrap();
    assert!(matches!(
        running.blocking_next(),
        Some(Ok(GenerateEvent::Delta { .. }))
    ));
    let waiting: Vec<_> = (0..2)
        .map(|i| engine.generate(request(&format!("Wait {i}"), 4)).unwrap())
        .collect();
    assert_eq!(engine.current_load().1, 2);
    let refused = Instant::now();
    match engine.generate(request("One too many", 4)) {
        Err(EngineError::Overloaded {
            waiting,
            retry_after,
        }) => {
            assert_eq!(waiting, 2);
            assert!(retry_after >= Duration::from_secs(1));
        }
        other => panic!("expected overload, got {:?}", other.map(|_| ())),
    }
    assert!(refused.elapsed() < Duration::from_secs(1));
    assert_eq!(engine.queue_stats().rejected_overloaded, 1);
    // Clients that leave free their places.
    drop(waiting);
    drop(running);
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.current_load().1 != 0 {
        assert!(Instant::now() < deadline, "the queue did not drain");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        receive(engine.generate(request("Hello", 4)).unwrap()).tokens,
        4
    );
}

/// A chat request body for the HTTP tests.
fn chat(content: &str, max_tokens: u32) -> Value {
    json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
    })
}

/// What one HTTP request got.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    /// When the answer came, and how long after sending.
    at: Instant,
    took: Duration,
    body: Value,
}

/// Sends `body` as `key` from a new thread.
fn send(
    addr: std::net::SocketAddr,
    key: Option<&'static str>,
    body: Value,
) -> std::thread::JoinHandle<Answer> {
    std::thread::spawn(move || {
        let text = body.to_string();
        let auth = key.map(|k| format!("Bearer {k}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(auth) = &auth {
            headers.push(("authorization", auth.as_str()));
        }
        let sent = Instant::now();
        let r = support::try_request(
            addr,
            "POST",
            "/v1/chat/completions",
            &headers,
            Some(text.as_bytes()),
        )
        .expect("an answer, not a hang or a dropped connection");
        Answer {
            status: r.status,
            retry_after: r.header("retry-after").map(str::to_owned),
            at: Instant::now(),
            took: sent.elapsed(),
            body: r.json(),
        }
    })
}

fn mean_secs(answers: &[Answer]) -> f64 {
    answers.iter().map(|a| a.took.as_secs_f64()).sum::<f64>() / answers.len().max(1) as f64
}

#[test]
fn two_hundred_requests_against_a_queue_of_32_complete_or_are_refused_with_retry_after() {
    let server = ServerBuilder::new()
        .model(real_model())
        .config(
            "[scheduler]\nmax_batch = 8\nmax_queued = 32\ntenant_queue_share = 1.0\n\
             [server]\nmax_concurrent_requests_per_key = 0\n",
        )
        .start();
    server.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let started = Instant::now();
    let sent: Vec<_> = (0..200)
        .map(|i| {
            send(
                server.addr,
                None,
                chat(&format!("Say hello to friend {i}."), 16),
            )
        })
        .collect();
    let answers: Vec<_> = sent.into_iter().map(|h| h.join().unwrap()).collect();
    let (mut completed, mut refused) = (0, 0);
    for a in &answers {
        let body = &a.body;
        match a.status {
            200 => completed += 1,
            503 => {
                refused += 1;
                assert_eq!(body["error"]["code"], "overloaded", "{body}");
                assert!(a.retry_after.is_some(), "503 without Retry-After: {body}");
                assert!(
                    a.at.duration_since(started) < Duration::from_secs(20),
                    "a refusal came only after {:?}",
                    a.at.duration_since(started)
                );
            }
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    assert_eq!(completed + refused, 200);
    assert!(completed >= 32, "only {completed} were served");
    assert!(refused > 0, "nothing was refused");
    let metrics = server.get("/metrics").text();
    assert!(
        metrics.contains(&format!(
            "mlxgate_model_requests_rejected_total{{model=\"SmolLM2-135M-Instruct\",reason=\"overloaded\"}} {refused}\n"
        )),
        "{metrics}"
    );
    assert!(metrics.contains("mlxgate_model_queue_limit{model=\"SmolLM2-135M-Instruct\"} 32\n"));
    // Afterwards the server serves as before and says it is ready.
    let ready = server.get("/readyz");
    assert_eq!(ready.status, 200);
    assert_eq!(
        ready.json()["queues"]["SmolLM2-135M-Instruct"]["waiting"],
        0
    );
    let after = send(server.addr, None, chat("Hi", 4)).join().unwrap();
    assert_eq!(after.status, 200, "{}", after.body);
}

/// A server of the packaged model with an `infer` key per `(tenant, key)`,
/// an admin key, and these `[scheduler]` lines; per-key request caps off.
fn server_with_tenants(tenants: &[(&str, &str)], scheduler: &str) -> support::Server {
    let keys: String = tenants
        .iter()
        .map(|(tenant, key)| {
            format!(
                "[[keys]]\nid = \"{tenant}\"\ntenant = \"{tenant}\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
                mlxgate::http::auth::KeyHash::of(key).to_hex()
            )
        })
        .collect();
    let server = ServerBuilder::new()
        .model(real_model())
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .config(&format!(
            "{keys}[scheduler]\n{scheduler}\n[server]\nmax_concurrent_requests_per_key = 0\n"
        ))
        .start();
    server.wait_for_status("/readyz", 200, Duration::from_secs(120));
    server
}

/// `n` chats (`label` and a number, so no two share a cached prompt) from
/// `key`'s tenant, each on its own thread.
fn send_many(
    server: &support::Server,
    key: &'static str,
    label: &str,
    n: usize,
    max_tokens: u32,
) -> Vec<std::thread::JoinHandle<Answer>> {
    (0..n)
        .map(|i| {
            send(
                server.addr,
                Some(key),
                chat(&format!("{label} {i}: say hi."), max_tokens),
            )
        })
        .collect()
}

fn join(handles: Vec<std::thread::JoinHandle<Answer>>) -> Vec<Answer> {
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Waits until at least `n` requests wait to start (as `/readyz` tells).
fn wait_for_queue(server: &support::Server, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.get("/readyz").json()["queues"]["SmolLM2-135M-Instruct"]["waiting"]
        .as_u64()
        .unwrap_or(0)
        < n
    {
        assert!(Instant::now() < deadline, "{n} requests never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const ADMIN: &str = "serving-admin-key";

const FLOOD: &str = "fair-flooding-tenant-key";
const QUIET: &str = "fair-quiet-tenant-key";

#[test]
fn a_flooding_tenant_does_not_starve_another_and_is_held_to_its_share() {
    let server = server_with_tenants(
        &[("a", FLOOD), ("b", QUIET)],
        "max_batch = 4\nmax_queued = 160\ntenant_queue_share = 0.5",
    );
    let unloaded = join(send_many(&server, QUIET, "Alone", 5, 6));
    let flood = send_many(&server, FLOOD, "Flood", 100, 6);
    // The flood is queued before the quiet tenant's few requests arrive.
    wait_for_queue(&server, 40);
    let quiet = join(send_many(&server, QUIET, "Quiet", 5, 6));
    let flood = join(flood);
    for a in quiet.iter().chain(&unloaded) {
        assert_eq!(a.status, 200, "{}", a.body);
    }
    // Past its share (80 of 160 waiting) the flood is refused with 429.
    let limited = flood.iter().filter(|f| f.status == 429).count();
    assert!(limited >= 10, "only {limited} of the flood got 429");
    for a in flood.iter().filter(|f| f.status != 200) {
        assert_eq!(a.status, 429, "{}", a.body);
        assert_eq!(
            a.body["error"]["code"], "tenant_queue_share_exceeded",
            "{}",
            a.body
        );
        assert!(a.retry_after.is_some());
    }
    // FIFO would finish all the flood's admitted requests first; fair
    // order interleaves the quiet tenant's with them.
    let quiet_done = quiet.iter().map(|q| q.at).max().unwrap();
    let served: Vec<Instant> = flood
        .iter()
        .filter(|f| f.status == 200)
        .map(|f| f.at)
        .collect();
    let before = served.iter().filter(|&&t| t < quiet_done).count();
    assert!(
        before <= 20,
        "{before} of the flood's {} requests finished before the quiet tenant's 5",
        served.len()
    );
    println!(
        "quiet tenant: {:.2} s per request beside the flood, {:.2} s unloaded ({:.1}x); {before} of {} flood requests finished first",
        mean_secs(&quiet),
        mean_secs(&unloaded),
        mean_secs(&quiet) / mean_secs(&unloaded),
        served.len()
    );
}

const VIP: &str = "priority-vip-key";
const BULK: &str = "priority-bulk-key";

/// The tenant-router example gives tenant `vip` priority class 1 (through
/// `request-control.set-priority`): with one sequence at a time, its
/// requests start before every waiting `bulk` request, where fair order
/// alone would alternate them.
#[test]
fn a_router_policy_s_priority_class_starts_first() {
    let server = server_with_tenants(
        &[("vip", VIP), ("bulk", BULK)],
        "max_batch = 1\ntenant_queue_share = 1.0",
    );
    let config = r#"{"tenants": {"vip": {"priority": 1}, "bulk": {}}}"#;
    let query = format!(
        "deadline_ms=200&config={}",
        config
            .bytes()
            .map(|b| format!("%{b:02X}"))
            .collect::<String>()
    );
    server.bind_router(ADMIN, "tenants", &query, &policy::wasm("tenant-router"));
    let bulk = send_many(&server, BULK, "Bulk", 8, 8);
    wait_for_queue(&server, 6);
    let vip = join(send_many(&server, VIP, "Vip", 4, 8));
    let bulk = join(bulk);
    for a in vip.iter().chain(&bulk) {
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let vip_done = vip.iter().map(|a| a.at).max().unwrap();
    let before = bulk.iter().filter(|a| a.at < vip_done).count();
    // The one running (and at most one starting) when vip's arrived; fair
    // order alone would let about four through.
    assert!(
        before <= 2,
        "{before} bulk requests finished before vip's last"
    );
}
