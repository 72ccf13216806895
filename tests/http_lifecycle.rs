//! Liveness, readiness and the model listing follow the model's load state,
//! SIGTERM lets an in-flight request finish before a clean exit, and each
//! request leaves a structured log line with its id.

mod support;

use std::time::Duration;

use support::{ServerBuilder, real_model};

const TEST_ROUTES: &str = "test_routes = true\n";

#[test]
fn healthz_answers_at_once_and_missing_model_makes_readyz_503_naming_the_path() {
    let s = ServerBuilder::new().start();
    let h = s.get("/healthz");
    assert_eq!(h.status, 200);
    assert_eq!(h.json(), serde_json::json!({"status": "ok"}));

    let path = s.model.display().to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let err = loop {
        let r = s.get("/readyz");
        let e = r.api_error(503, "server_error", "model_not_ready");
        let msg = e["message"].as_str().unwrap_or_default().to_owned();
        if msg.contains("failed to load") || std::time::Instant::now() > deadline {
            break msg;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(err.contains("failed to load"), "{err}");
    assert!(err.contains(&path), "message should name {path}: {err}");
    assert!(
        s.log_text().contains("model failed to load"),
        "log:\n{}",
        s.log_text()
    );
    // Still alive, and nothing listed.
    assert_eq!(s.get("/healthz").status, 200);
    assert_eq!(
        s.get("/v1/models").json(),
        serde_json::json!({"object": "list", "data": []})
    );
}

#[test]
fn readyz_turns_200_once_the_real_model_loads_and_models_lists_it() {
    let model = real_model();
    assert!(
        model.is_file(),
        "{} is missing: run the setup script to install the model",
        model.display()
    );
    let s = ServerBuilder::new().model(&model).start();
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(60));
    let id = ready.json()["model"]
        .as_str()
        .expect("readyz names the model")
        .to_owned();
    assert!(id.starts_with("SmolLM2-135M-Instruct"), "{id}");

    let list = s.get("/v1/models");
    assert_eq!(list.status, 200);
    let v = list.json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().expect("data array");
    assert_eq!(data.len(), 1, "{v}");
    assert_eq!(data[0]["id"], id.as_str());
    assert_eq!(data[0]["object"], "model");
    assert_eq!(data[0]["owned_by"], "mlxgate");
    assert!(data[0]["created"].as_u64().is_some_and(|c| c > 0), "{v}");

    let one = s.get(&format!("/v1/models/{id}"));
    assert_eq!(one.status, 200);
    assert_eq!(one.json(), data[0]);

    s.get("/v1/models/gpt-17")
        .api_error(404, "not_found_error", "model_not_found");
}

#[test]
fn sigterm_lets_an_in_flight_request_finish_then_exits_zero() {
    let mut s = ServerBuilder::new().config(TEST_ROUTES).start();
    let addr = s.addr;
    let slow = std::thread::spawn(move || {
        support::try_request(addr, "GET", "/__test/sleep?ms=1500", &[], None)
    });
    // Let the request reach the handler before signalling.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !s
        .get("/metrics")
        .text()
        .contains("mlxgate_http_requests_in_flight 2")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "slow request never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s.sigterm();
    let status = s.wait_exit(Duration::from_secs(10));
    let r = slow
        .join()
        .expect("client thread")
        .expect("slow request answered");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["slept_ms"], 1500);
    assert!(
        status.success(),
        "exit status {status}; log:\n{}",
        s.log_text()
    );
    // And it really stopped listening.
    assert!(support::try_request(addr, "GET", "/healthz", &[], None).is_err());
}

#[test]
fn sigterm_stops_an_overlong_request_after_the_grace_period() {
    let mut s = ServerBuilder::new()
        .config(&format!("{TEST_ROUTES}shutdown_grace_secs = 1\n"))
        .start();
    let addr = s.addr;
    let slow = std::thread::spawn(move || {
        support::try_request(addr, "GET", "/__test/sleep?ms=30000", &[], None)
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !s
        .get("/metrics")
        .text()
        .contains("mlxgate_http_requests_in_flight 2")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "slow request never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = std::time::Instant::now();
    s.sigterm();
    let status = s.wait_exit(Duration::from_secs(10));
    assert!(status.success(), "exit status {status}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert!(slow.join().expect("client thread").is_err());
}

#[test]
fn json_logs_carry_the_request_id_route_and_status() {
    let s = ServerBuilder::new().arg("--log-format").arg("json").start();
    let r = s.get_with("/v1/models/x", &[("x-request-id", "log-check-1")]);
    assert_eq!(r.status, 404);
    assert_eq!(r.header("x-request-id"), Some("log-check-1"));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let log = s.log_text();
        let found = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["span"]["id"] == "log-check-1" && v["message"] == "request done");
        if let Some(v) = found {
            assert_eq!(v["route"], "/v1/models/{id}", "{v}");
            assert_eq!(v["status"], 404, "{v}");
            assert_eq!(v["key_id"], "anonymous", "{v}");
            // Every line is JSON: nothing unstructured slips in.
            for l in log.lines() {
                assert!(serde_json::from_str::<serde_json::Value>(l).is_ok(), "{l}");
            }
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no access log line:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
