//! /metrics counts requests by method, matched route pattern and status.

mod support;

use support::ServerBuilder;

fn sample(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn metrics_count_requests_by_route_pattern_and_status() {
    let s = ServerBuilder::new().start();
    for _ in 0..3 {
        assert_eq!(s.get("/healthz").status, 200);
    }
    for id in ["a", "b"] {
        assert_eq!(s.get(&format!("/v1/models/{id}")).status, 404);
    }
    assert_eq!(s.get("/no/such/route").status, 404);
    assert_eq!(s.get("/readyz").status, 503);

    let r = s.get("/metrics");
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/plain; version=0.0.4")),
        "{:?}",
        r.header("content-type")
    );
    let t = r.text();
    let count = |labels: &str| sample(&t, &format!("mlxgate_http_requests_total{{{labels}}}"));
    // /healthz answered 3 times before this scrape (plus the readiness poll of
    // the test helper, which also hits /healthz at least once).
    let health = count(r#"method="GET",route="/healthz",status="200""#).unwrap_or(0);
    assert!(health >= 4, "{t}");
    // Pattern, not raw path: both ids land in one series.
    assert_eq!(
        count(r#"method="GET",route="/v1/models/{id}",status="404""#),
        Some(2),
        "{t}"
    );
    assert!(
        !t.contains("/v1/models/a"),
        "raw path leaked into labels:\n{t}"
    );
    assert_eq!(
        count(r#"method="GET",route="unmatched",status="404""#),
        Some(1),
        "{t}"
    );
    assert_eq!(
        count(r#"method="GET",route="/readyz",status="503""#),
        Some(1),
        "{t}"
    );
    assert!(t.contains("# TYPE mlxgate_http_request_duration_seconds histogram"));
    assert_eq!(
        sample(
            &t,
            r#"mlxgate_http_request_duration_seconds_count{method="GET",route="/v1/models/{id}",status="404"}"#
        ),
        Some(2)
    );
    assert!(t.contains(r#"le="+Inf"}"#));
    assert!(t.contains("mlxgate_model_ready 0\n"), "{t}");

    // The scrape itself shows up in the next scrape.
    let t2 = s.get("/metrics").text();
    assert_eq!(
        sample(
            &t2,
            r#"mlxgate_http_requests_total{method="GET",route="/metrics",status="200"}"#
        ),
        Some(1)
    );
}
