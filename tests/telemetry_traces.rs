//! `[telemetry] otlp_endpoint`: one OpenTelemetry trace per request,
//! exported over OTLP/HTTP to a real receiver (here, in the test: a hyper
//! server decoding the protobuf), with the request-path spans (`request`,
//! `auth`, `route`, `upstream`) and a local model's phases (`queue`,
//! `prefill`, `decode`); a client's `traceparent` is the trace's parent,
//! and the upstream call carries its own `traceparent` on.

#[path = "routing_common/mod.rs"]
mod routing;
#[path = "support/mod.rs"]
mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use serde_json::json;
use support::{ServerBuilder, real_model};

/// A span as received: ids in hex.
#[derive(Debug, Clone)]
struct Received {
    name: String,
    trace: String,
    id: String,
    parent: String,
    attributes: Vec<(String, String)>,
    start: u64,
    end: u64,
}

impl Received {
    fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// An OTLP/HTTP receiver: `POST /v1/traces`, protobuf, spans kept.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    _rt: tokio::runtime::Runtime,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

impl Receiver {
    fn start() -> Receiver {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&spans);
        rt.spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let kept = Arc::clone(&kept);
                        async move {
                            assert_eq!(req.uri().path(), "/v1/traces");
                            assert_eq!(req.headers()["content-type"], "application/x-protobuf");
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let export =
                                ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                            let mut kept = kept.lock().unwrap();
                            for rs in export.resource_spans {
                                let service = rs
                                    .resource
                                    .iter()
                                    .flat_map(|r| &r.attributes)
                                    .any(|a| a.key == "service.name");
                                assert!(service, "service.name on the resource");
                                for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                                    let attributes = s
                                        .attributes
                                        .iter()
                                        .map(|a| {
                                            let v = match a
                                                .value
                                                .as_ref()
                                                .and_then(|v| v.value.as_ref())
                                            {
                                                Some(AnyValue::StringValue(s)) => s.clone(),
                                                Some(AnyValue::IntValue(i)) => i.to_string(),
                                                Some(other) => format!("{other:?}"),
                                                None => String::new(),
                                            };
                                            (a.key.clone(), v)
                                        })
                                        .collect();
                                    kept.push(Received {
                                        name: s.name,
                                        trace: hex(&s.trace_id),
                                        id: hex(&s.span_id),
                                        parent: hex(&s.parent_span_id),
                                        attributes,
                                        start: s.start_time_unix_nano,
                                        end: s.end_time_unix_nano,
                                    });
                                }
                            }
                            let mut r = hyper::Response::new(Full::new(Bytes::new()));
                            r.headers_mut()
                                .insert("content-type", "application/x-protobuf".parse().unwrap());
                            Ok::<_, Infallible>(r)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        Receiver {
            addr,
            spans,
            _rt: rt,
        }
    }

    /// The spans of `trace` once `names` have all arrived.
    fn trace(&self, trace: &str, names: &[&str]) -> Vec<Received> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let spans: Vec<Received> = self
                .spans
                .lock()
                .unwrap()
                .iter()
                .filter(|s| s.trace == trace)
                .cloned()
                .collect();
            if names.iter().all(|n| spans.iter().any(|s| s.name == *n)) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "spans {names:?} of trace {trace} did not all arrive: {spans:#?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A short chat completion for `model` with `headers`.
fn chat(s: &support::Server, headers: &[(&str, &str)], model: &str) -> support::Response {
    let body =
        json!({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
            .to_string();
    let mut headers = headers.to_vec();
    headers.push(("content-type", "application/json"));
    s.request(
        "POST",
        "/v1/chat/completions",
        &headers,
        Some(body.as_bytes()),
    )
}

#[test]
fn each_request_is_one_trace_with_its_steps_and_the_upstream_sees_it() {
    let receiver = Receiver::start();
    let upstream = routing::FakeUpstream::start();
    let admin = "traces-admin-key";
    let config = format!(
        "[[upstreams]]\nname = \"up\"\nbase_url = \"{}\"\nmodels = [\"static-model\"]\n\
         [telemetry]\notlp_endpoint = \"http://{}\"\nexport_delay_ms = 100\n",
        upstream.base_url(),
        receiver.addr
    );
    let s = ServerBuilder::new()
        .config(&config)
        .model(real_model())
        .env("MLXGATE_ADMIN_KEY", admin)
        .start();
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let model = ready.json()["model"].as_str().unwrap().to_owned();
    let auth = format!("Bearer {admin}");

    // A local request under the client's trace.
    let (client_trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let traceparent = format!("00-{client_trace}-{client_span}-01");
    let r = chat(
        &s,
        &[("authorization", &auth), ("traceparent", &traceparent)],
        &model,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let spans = receiver.trace(
        client_trace,
        &["request", "auth", "route", "queue", "prefill", "decode"],
    );
    let request = spans.iter().find(|s| s.name == "request").unwrap();
    assert_eq!(
        request.parent, client_span,
        "the client's span is the parent"
    );
    assert_eq!(request.attribute("status"), Some("200"));
    assert_eq!(request.attribute("path"), Some("/v1/chat/completions"));
    for name in ["auth", "route", "queue", "prefill", "decode"] {
        let span = spans.iter().find(|s| s.name == name).unwrap();
        assert_eq!(span.parent, request.id, "{name} is a step of the request");
        assert!(
            span.start <= span.end && span.start >= request.start,
            "{span:?} within {request:?}"
        );
    }
    let phase = |n: &str| spans.iter().find(|s| s.name == n).unwrap().clone();
    assert!(phase("queue").end <= phase("prefill").start + 1_000);
    assert!(phase("prefill").end <= phase("decode").start + 1_000);
    assert!(
        phase("decode").end <= request.end,
        "the request span lasts until its last token"
    );
    assert_eq!(
        spans.iter().filter(|s| s.name == "request").count(),
        1,
        "one request span"
    );

    // A proxied request: its own trace, and the upstream call's context sent on.
    let r = chat(&s, &[("authorization", &auth)], "static-model");
    assert_eq!(r.status, 200, "{}", r.text());
    let sent = r.json()["traceparent"]
        .as_str()
        .expect("a traceparent reached the upstream")
        .to_owned();
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!((parts.len(), parts[0], parts[3]), (4, "00", "01"), "{sent}");
    let spans = receiver.trace(parts[1], &["request", "auth", "route", "upstream"]);
    let upstream_span = spans.iter().find(|s| s.name == "upstream").unwrap();
    assert_eq!(
        upstream_span.id, parts[2],
        "the upstream's parent is the upstream span"
    );
    assert_eq!(upstream_span.attribute("upstream"), Some("up"));
    let request = spans.iter().find(|s| s.name == "request").unwrap();
    assert_eq!(upstream_span.parent, request.id);
    assert!(request.parent.is_empty(), "no client trace: a root span");
    assert_ne!(parts[1], client_trace);
}
