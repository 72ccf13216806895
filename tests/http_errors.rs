//! Every failure a client can cause answers with the OpenAI error JSON and
//! the right status, and none of them takes the server down.

mod support;

use support::{Server, ServerBuilder};

/// Small body limit so oversize tests send little data.
fn server() -> Server {
    ServerBuilder::new()
        .config("test_routes = true\nmax_body_bytes = 1024\n")
        .start()
}

#[test]
fn unknown_route_is_404_json() {
    let s = server();
    let e = s
        .get("/nope")
        .api_error(404, "not_found_error", "unknown_url");
    assert!(e["message"].as_str().unwrap_or_default().contains("/nope"));
    s.get("/v1/nope")
        .api_error(404, "not_found_error", "unknown_url");
    s.get("/healthz/")
        .api_error(404, "not_found_error", "unknown_url");
}

#[test]
fn wrong_method_is_405_json_with_allow_header() {
    let s = server();
    let r = s.request("POST", "/healthz", &[], Some(b"{}"));
    r.api_error(405, "invalid_request_error", "method_not_allowed");
    assert_eq!(r.header("allow"), Some("GET"));
    let r = s.request("DELETE", "/v1/models", &[], None);
    r.api_error(405, "invalid_request_error", "method_not_allowed");
}

#[test]
fn malformed_json_is_400_json() {
    let s = server();
    let e = s
        .request(
            "POST",
            "/__test/echo",
            &[("content-type", "application/json")],
            Some(b"{\"a\": "),
        )
        .api_error(400, "invalid_request_error", "invalid_json");
    assert!(
        e["message"].as_str().unwrap_or_default().contains("JSON"),
        "{e}"
    );
    // Well-formed JSON passes through the same route.
    let ok = s.request("POST", "/__test/echo", &[], Some(br#"{"a":[1,2]}"#));
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json(), serde_json::json!({"a": [1, 2]}));
}

#[test]
fn declared_oversize_body_is_413_before_it_is_sent() {
    let s = server();
    // Claims 10 MB but sends only a few bytes: the server must answer from
    // the header alone instead of waiting for (or buffering) the body.
    let raw = format!(
        "POST /__test/echo HTTP/1.1\r\nHost: {}\r\nContent-Length: 10000000\r\n\r\n{{\"a\":",
        s.addr
    );
    let e = s
        .raw(raw.as_bytes())
        .api_error(413, "invalid_request_error", "request_too_large");
    assert!(
        e["message"].as_str().unwrap_or_default().contains("1024"),
        "{e}"
    );
}

#[test]
fn streamed_oversize_body_is_413() {
    let s = server();
    // Chunked, so no length up front: the limit must hold while streaming.
    let chunk = "x".repeat(600);
    let raw = format!(
        "POST /__test/echo HTTP/1.1\r\nHost: {}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
         258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n",
        s.addr
    );
    s.raw(raw.as_bytes())
        .api_error(413, "invalid_request_error", "request_too_large");
    // A body within the limit still works.
    assert_eq!(
        s.request("POST", "/__test/echo", &[], Some(b"[1]")).status,
        200
    );
}

#[test]
fn handler_panic_is_500_json_and_server_keeps_serving() {
    let s = server();
    for _ in 0..3 {
        s.get("/__test/panic")
            .api_error(500, "server_error", "internal_error");
    }
    assert_eq!(s.get("/healthz").status, 200);
}

#[test]
fn request_id_is_echoed_when_sane_and_generated_otherwise() {
    let s = server();
    let r = s.get_with("/healthz", &[("x-request-id", "abc-123")]);
    assert_eq!(r.header("x-request-id"), Some("abc-123"));
    let r = s.get_with("/healthz", &[("x-request-id", "bad id with spaces")]);
    let id = r.header("x-request-id").expect("generated id");
    assert!(!id.is_empty() && id != "bad id with spaces", "{id}");
    let other = s.get("/nope");
    let other_id = other
        .header("x-request-id")
        .expect("errors carry an id too");
    assert_ne!(other_id, id);
}

#[test]
fn test_routes_are_absent_unless_enabled() {
    let s = ServerBuilder::new().start();
    s.get("/__test/panic")
        .api_error(404, "not_found_error", "unknown_url");
}

/// A fault on the engine thread while generating one request (an injected
/// panic in its decode step; debug builds serving `test_routes` only)
/// answers that request 500 in the OpenAI shape, and the model keeps
/// serving: it stays ready and the next request gets the same answer as
/// before the fault.
#[test]
#[cfg_attr(
    not(debug_assertions),
    ignore = "faults are injected by debug builds only"
)]
fn an_engine_fault_fails_its_request_and_the_model_keeps_serving() {
    use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let s = ServerBuilder::new()
        .config("test_routes = true\n")
        .model(dir.path())
        .env(
            "MLXGATE_TEST_ENGINE_FAULTS",
            "decode_panic=256,prefill_panic=257",
        )
        .start();
    let ready = s.wait_for_status("/readyz", 200, std::time::Duration::from_secs(60));
    let model = ready.json()["model"].as_str().unwrap().to_owned();
    let complete = |prompt: &[u32], stream: bool| {
        let body = serde_json::json!({
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "logit_bias": {"2": -100}, "stream": stream,
        });
        s.request(
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            Some(body.to_string().as_bytes()),
        )
    };
    let answer = |prompt: &[u32]| {
        let r = complete(prompt, false);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    let before = answer(&[3, 4, 5]);
    for marked in [[3, 256, 5], [3, 257, 5]] {
        let e = complete(&marked, false).api_error(500, "server_error", "internal_error");
        assert!(e["message"].as_str().unwrap().contains("injected"), "{e}");
        // Streamed, the failure is an error event after the 200 head.
        let r = complete(&marked, true);
        assert_eq!(r.status, 200);
        assert!(r.text().contains("internal_error"), "{}", r.text());
        assert_eq!(s.get("/readyz").status, 200);
        assert_eq!(answer(&[3, 4, 5]), before);
    }
}
