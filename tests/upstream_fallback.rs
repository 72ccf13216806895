//! Fallback between upstreams, against the real binary and real HTTP
//! upstreams on loopback whose behaviour the test switches: a request whose
//! first upstream answers 503, answers 429 with `Retry-After` or hangs past
//! its timeout is served by the next; `Retry-After` keeps the first away
//! until then; repeated failures open its circuit, and a good probe after
//! the cooldown closes it; an active health check opens and closes a
//! circuit without any client request; nothing is retried once an answer
//! has started streaming to the client; a router sees each upstream's
//! recent latency (`backend-stats.latency-ms`).

#[path = "policy_common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use support::{Server, ServerBuilder};

const ADMIN: &str = "fallback-admin";

/// What a [`Scripted`] upstream does with the next requests.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Mode {
    /// 200 with a chat completion naming the upstream.
    Ok = 0,
    Unavailable = 1,
    /// 429 with `Retry-After: 2`.
    RateLimited = 2,
    /// Never answers.
    Hang = 3,
    /// 200, one SSE event, then the connection drops.
    BreakStream = 4,
    /// 200 as `Ok`, after 150 ms.
    Slow = 5,
}

/// An upstream on loopback (hyper, its own runtime) behaving as its
/// current [`Mode`] says, counting the requests it gets.
struct Scripted {
    addr: SocketAddr,
    mode: Arc<AtomicU8>,
    hits: Arc<AtomicUsize>,
    health_hits: Arc<AtomicUsize>,
    _rt: tokio::runtime::Runtime,
}

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

impl Scripted {
    fn start(name: &'static str) -> Scripted {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, hits, health_hits) = (
            Arc::new(AtomicU8::new(Mode::Ok as u8)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let state = (mode.clone(), hits.clone(), health_hits.clone());
        rt.spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let state = state.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        answer(name, req, state.0.clone(), state.1.clone(), state.2.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        Scripted {
            addr,
            mode,
            hits,
            health_hits,
            _rt: rt,
        }
    }

    fn set(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

fn reply(status: StatusCode, v: Value) -> Response<Body> {
    let body = Full::new(Bytes::from(v.to_string())).map_err(|e: Infallible| match e {});
    let mut r = Response::new(body.boxed_unsync());
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

async fn answer(
    name: &'static str,
    req: Request<Incoming>,
    mode: Arc<AtomicU8>,
    hits: Arc<AtomicUsize>,
    health_hits: Arc<AtomicUsize>,
) -> Result<Response<Body>, Infallible> {
    let health = req.method() == http::Method::GET;
    let _ = req.into_body().collect().await;
    let mode = mode.load(Ordering::SeqCst);
    if health {
        health_hits.fetch_add(1, Ordering::SeqCst);
        let status = if mode == Mode::Ok as u8 {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        return Ok(reply(status, json!({"object": "list", "data": []})));
    }
    hits.fetch_add(1, Ordering::SeqCst);
    let error = |status, code| {
        reply(
            status,
            json!({"error": {"message": name, "type": "x", "param": null, "code": code}}),
        )
    };
    Ok(match mode {
        m if m == Mode::Unavailable as u8 => error(StatusCode::SERVICE_UNAVAILABLE, "down"),
        m if m == Mode::RateLimited as u8 => {
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "slow_down");
            r.headers_mut().insert("retry-after", "2".parse().unwrap());
            r
        }
        m if m == Mode::Hang as u8 => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            error(StatusCode::GATEWAY_TIMEOUT, "late")
        }
        m if m == Mode::BreakStream as u8 => {
            let first =
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{name}\"}}}}]}}\n\n");
            // The first event goes out (and is flushed) before the failure.
            let events = futures_util::stream::unfold(0, move |step| {
                let first = first.clone();
                async move {
                    match step {
                        0 => Some((Ok(Frame::data(Bytes::from(first))), 1)),
                        1 => {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            Some((Err(std::io::Error::other("upstream died")), 2))
                        }
                        _ => None,
                    }
                }
            });
            let mut r = Response::new(StreamBody::new(events).boxed_unsync());
            r.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            r
        }
        m => {
            if m == Mode::Slow as u8 {
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            reply(
                StatusCode::OK,
                json!({"id": "x", "object": "chat.completion", "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": name}, "finish_reason": "stop"}]}),
            )
        }
    })
}

fn chat(stream: bool) -> Value {
    json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
}

/// The gateway under test with `config`, the admin key its only key.
fn gateway(config: &str) -> Server {
    ServerBuilder::new()
        .config(config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start()
}

/// A chat request with the admin key (the only key configured).
fn post_chat(s: &Server) -> support::Response {
    let auth = format!("Bearer {ADMIN}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    s.request(
        "POST",
        "/v1/chat/completions",
        &headers,
        Some(chat(false).to_string().as_bytes()),
    )
}

/// Who answered a chat request: the `x-mlxgate-upstream` header.
fn served_by(s: &Server) -> String {
    let r = post_chat(s);
    assert_eq!(r.status, 200, "{}\n{}", r.text(), s.log_text());
    r.header("x-mlxgate-upstream").unwrap().to_owned()
}

/// `GET /admin/upstreams` entry of `name`.
fn status(s: &Server, name: &str) -> Value {
    let auth = format!("Bearer {ADMIN}");
    let r = s.get_with("/admin/upstreams", &[("authorization", &auth)]);
    let v = r.json();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == name)
        .unwrap()
        .clone()
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn failures_before_the_answer_fall_back_and_open_the_circuit() {
    let (a, b, c) = (
        Scripted::start("a"),
        Scripted::start("b"),
        Scripted::start("c"),
    );
    let config = format!(
        "[[upstreams]]\nname = \"a\"\nbase_url = \"{}\"\nmodels = [\"m\"]\nfallbacks = [\"b\"]\n\
         timeout_secs = 1.0\nbreaker_failures = 3\nbreaker_cooldown_secs = 2.0\n\
         [[upstreams]]\nname = \"b\"\nbase_url = \"{}\"\n\
         [[upstreams]]\nname = \"c\"\nbase_url = \"{}\"\nbreaker_failures = 2\nbreaker_cooldown_secs = 1.0\n\
         health_check = {{ path = \"/models\", interval_secs = 0.2, timeout_secs = 1.0 }}\n",
        a.url(),
        b.url(),
        c.url()
    );
    let s = gateway(&config);

    assert_eq!(served_by(&s), "a");
    // 503: served by b.
    a.set(Mode::Unavailable);
    assert_eq!(served_by(&s), "b");
    assert_eq!(a.hits(), 2);
    // 429 with Retry-After: 2: b now, and a is not asked until then.
    a.set(Mode::RateLimited);
    assert_eq!(served_by(&s), "b");
    assert_eq!(a.hits(), 3);
    a.set(Mode::Ok);
    assert_eq!(served_by(&s), "b");
    assert_eq!(a.hits(), 3, "a was asked inside its Retry-After");
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(served_by(&s), "a");
    // Hanging past its 1 s timeout: b, after the timeout.
    a.set(Mode::Hang);
    let started = Instant::now();
    assert_eq!(served_by(&s), "b");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );

    // Three failures in a row (the hang was the first) open a's circuit.
    a.set(Mode::Unavailable);
    for _ in 0..2 {
        assert_eq!(served_by(&s), "b");
    }
    assert_eq!(status(&s, "a")["circuit"], "open");
    assert_eq!(status(&s, "a")["healthy"], false);
    let asked = a.hits();
    assert_eq!(served_by(&s), "b");
    assert_eq!(a.hits(), asked, "a was asked with its circuit open");
    // After the cooldown one request probes a; a good answer closes it.
    a.set(Mode::Ok);
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(served_by(&s), "a");
    assert_eq!(status(&s, "a")["circuit"], "closed");
    assert!(status(&s, "a")["latency_ms"].as_f64().unwrap() > 0.0);

    // The health check alone opens c's circuit, and closes it once healthy.
    assert_eq!(status(&s, "c")["circuit"], "closed");
    c.set(Mode::Unavailable);
    wait_until("c's circuit to open", || {
        status(&s, "c")["circuit"] == "open"
    });
    assert_eq!(c.hits(), 0, "no client request reached c");
    c.set(Mode::Ok);
    wait_until("c's circuit to close", || {
        status(&s, "c")["circuit"] == "closed"
    });
    assert!(c.health_hits.load(Ordering::SeqCst) >= 3);

    // With every upstream failing, the client gets the last one's own answer.
    a.set(Mode::Unavailable);
    b.set(Mode::Unavailable);
    let r = post_chat(&s);
    assert_eq!(
        (r.status, r.header("x-mlxgate-upstream")),
        (503, Some("b")),
        "{}",
        r.text()
    );
}

#[test]
fn nothing_is_retried_once_an_answer_has_started_streaming() {
    let (a, b) = (Scripted::start("a"), Scripted::start("b"));
    let config = format!(
        "[[upstreams]]\nname = \"a\"\nbase_url = \"{}\"\nmodels = [\"m\"]\nfallbacks = [\"b\"]\n\
         [[upstreams]]\nname = \"b\"\nbase_url = \"{}\"\n",
        a.url(),
        b.url()
    );
    let s = ServerBuilder::new().config(&config).start();
    a.set(Mode::BreakStream);
    // Raw, read to the end: the answer is cut short, so no HTTP client
    // would hand it over whole.
    let body = chat(true).to_string();
    let mut conn = std::net::TcpStream::connect(s.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let _ = conn.read_to_end(&mut seen);
    let seen = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    assert!(seen.starts_with("http/1.1 200"), "{seen}");
    assert!(seen.contains("x-mlxgate-upstream: a"), "{seen}");
    assert!(
        seen.contains("{\"content\":\"a\"}"),
        "a's first event reached the client: {seen}"
    );
    assert!(
        !seen.contains("[done]") && !seen.ends_with("0\r\n\r\n"),
        "{seen}"
    );
    assert_eq!(
        (a.hits(), b.hits()),
        (1, 0),
        "b was asked after a had started streaming"
    );
}

#[test]
fn a_router_sees_each_upstreams_recent_latency() {
    let (slow, fast) = (Scripted::start("slow"), Scripted::start("fast"));
    slow.set(Mode::Slow);
    let config = format!(
        "[[upstreams]]\nname = \"slow\"\nbase_url = \"{}\"\n\
         [[upstreams]]\nname = \"fast\"\nbase_url = \"{}\"\n",
        slow.url(),
        fast.url()
    );
    let s = gateway(&config);
    // `least-loaded` breaks ties in load by latency (not measured first).
    s.bind_router(ADMIN, "ll", "", &common::wasm("least-loaded"));

    // Both unmeasured: the first listed; then the one not measured yet.
    assert_eq!(served_by(&s), "slow");
    assert_eq!(served_by(&s), "fast");
    // Measured: every later request goes to the one that answers sooner.
    for _ in 0..5 {
        assert_eq!(served_by(&s), "fast");
    }
    assert_eq!((slow.hits(), fast.hits()), (1, 6));
    let slow_ms = status(&s, "slow")["latency_ms"].as_f64().unwrap();
    let fast_ms = status(&s, "fast")["latency_ms"].as_f64().unwrap();
    assert!(
        slow_ms >= 140.0 && fast_ms < slow_ms,
        "{slow_ms} / {fast_ms}"
    );
}

#[test]
fn a_messages_request_translated_for_openai_upstreams_falls_back_too() {
    let (a, b) = (Scripted::start("a"), Scripted::start("b"));
    a.set(Mode::Unavailable);
    let config = format!(
        "[[upstreams]]\nname = \"a\"\nbase_url = \"{}\"\nmodels = [\"m\"]\nfallbacks = [\"b\"]\n\
         [[upstreams]]\nname = \"b\"\nbase_url = \"{}\"\n",
        a.url(),
        b.url()
    );
    let s = gateway(&config);
    let body =
        json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]});
    let headers = [
        ("x-api-key", ADMIN),
        ("anthropic-version", "2023-06-01"),
        ("content-type", "application/json"),
    ];
    let r = s.request(
        "POST",
        "/v1/messages",
        &headers,
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(r.status, 200, "{}\n{}", r.text(), s.log_text());
    let v = r.json();
    // b's OpenAI answer, in Anthropic's shape.
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(v["content"][0]["text"], "b", "{v}");
    assert_eq!((a.hits(), b.hits()), (1, 1));
}
