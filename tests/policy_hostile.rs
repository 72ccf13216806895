//! Containment: hostile guests fail with the right error, the host and other
//! policies keep working, and a policy works again after a trap (with a fresh
//! instance). Also every upload validation error. Needs
//! `scripts/build-policies.sh` to have run.

#[path = "policy_common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use mlxgate::policy::{
    FailureKind, Limits, OnError, PolicyError, PolicyKind, PolicyOptions, RecordOutcome,
    RouteDecision,
};

/// Uploads the hostile router with `deadline_ms` (50 ms unless a test is
/// about the default) and a well-behaved `good` router next to it.
fn hostile_host_with(
    on_error: OnError,
    deadline_ms: u32,
) -> (tempfile::TempDir, mlxgate::policy::PolicyHost) {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    host.upload(
        "hostile",
        PolicyKind::Router,
        &wasm("hostile-router"),
        PolicyOptions {
            on_error,
            limits: Some(Limits {
                deadline_ms,
                ..PolicyKind::Router.default_limits()
            }),
            ..PolicyOptions::default()
        },
    )
    .unwrap();
    upload(&host, "good", PolicyKind::Router, "alias-router", "");
    (dir, host)
}

fn hostile_host(on_error: OnError) -> (tempfile::TempDir, mlxgate::policy::PolicyHost) {
    hostile_host_with(on_error, 50)
}

fn failure(err: PolicyError) -> FailureKind {
    match err {
        PolicyError::Guest { kind, .. } => kind,
        other => panic!("expected a guest failure, got {other}"),
    }
}

#[test]
fn each_misbehaviour_is_contained_and_the_policy_recovers() {
    let (_dir, host) = hostile_host(OnError::FailClosed);
    let cases = [
        ("loop", FailureKind::Timeout),
        ("oom", FailureKind::MemoryLimit),
        ("recurse", FailureKind::StackOverflow),
        ("panic", FailureKind::Panic),
        ("huge", FailureKind::BadOutput),
    ];
    for (model, expected) in cases {
        let start = Instant::now();
        let err = host.route_with("hostile", &facts(model), &[]).unwrap_err();
        assert!(!err.is_fail_open(), "fail_closed policy");
        assert_eq!(common::status(&err), 503);
        assert_eq!(failure(err), expected, "model {model}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{model} took {:?}",
            start.elapsed()
        );

        // The same policy answers again, on a fresh instance after a trap.
        assert_eq!(
            host.route_with("hostile", &facts("fine"), &[]).unwrap(),
            RouteDecision::local("fine"),
            "after {model}"
        );
        // Other policies are unaffected.
        assert_eq!(
            host.route_with("good", &facts("llama"), &[local("llama", 0, 0)])
                .unwrap(),
            RouteDecision::local("llama")
        );
    }
    let m = host
        .metrics()
        .into_iter()
        .find(|m| m.name == "hostile")
        .unwrap();
    for (_, kind) in cases {
        assert_eq!(m.failures_of(kind), 1, "{kind}");
    }
    assert_eq!(m.calls, 10);
    // Four traps replaced the instance; bad output did not.
    assert_eq!(m.instances_created, 5);
}

#[test]
fn instances_that_grew_large_are_retired_not_pooled() {
    let (_dir, host) = hostile_host(OnError::FailClosed);
    let created = || {
        host.metrics()
            .into_iter()
            .find(|m| m.name == "hostile")
            .unwrap()
            .instances_created
    };
    host.route_with("hostile", &facts("a"), &[]).unwrap();
    host.route_with("hostile", &facts("b"), &[]).unwrap();
    assert_eq!(created(), 1, "small calls reuse one warm instance");
    host.route_with("hostile", &facts("grow"), &[]).unwrap();
    assert_eq!(host.warm_instances("hostile"), Some(0));
    host.route_with("hostile", &facts("c"), &[]).unwrap();
    assert_eq!(created(), 2, "the grown instance was replaced");
    assert_eq!(host.warm_instances("hostile"), Some(1));
}

#[test]
fn fail_open_policies_tell_callers_to_use_the_default_route() {
    let (_dir, host) = hostile_host(OnError::FailOpen);
    host.bind(PolicyKind::Router, "hostile").unwrap();
    let err = host.route(&facts("panic"), &[]).unwrap_err();
    assert!(err.is_fail_open());
    assert_eq!(failure(err), FailureKind::Panic);
    assert!(host.route(&facts("ok"), &[]).is_ok());
}

#[test]
fn a_tight_deadline_is_enforced_within_a_few_milliseconds() {
    let deadline = PolicyKind::Router.default_limits().deadline_ms;
    assert_eq!(deadline, 5);
    let (_dir, host) = hostile_host_with(OnError::FailClosed, deadline);
    let start = Instant::now();
    let err = host.route_with("hostile", &facts("loop"), &[]).unwrap_err();
    let took = start.elapsed();
    assert_eq!(failure(err), FailureKind::Timeout);
    // Deadline 5 ms; generous bound for a loaded 2-core CI machine.
    assert!(took < Duration::from_millis(500), "{took:?}");
}

#[test]
fn deadlines_hold_after_the_watchdog_parked() {
    // The watchdog parks while no call runs; a call must wake it, or this
    // loop would never be interrupted.
    let (_dir, host) = hostile_host_with(OnError::FailClosed, 5);
    std::thread::sleep(Duration::from_millis(400));
    let start = Instant::now();
    let err = host.route_with("hostile", &facts("loop"), &[]).unwrap_err();
    assert_eq!(failure(err), FailureKind::Timeout);
    assert!(start.elapsed() < Duration::from_millis(500));
}

#[test]
fn a_long_deadline_fires_near_its_time() {
    // The watchdog parks when idle and sleeps until the earliest deadline:
    // a 300 ms call must be stopped at 300 ms, not earlier and not never.
    let (_dir, host) = hostile_host_with(OnError::FailClosed, 300);
    let start = Instant::now();
    let err = host.route_with("hostile", &facts("loop"), &[]).unwrap_err();
    assert_eq!(failure(err), FailureKind::Timeout);
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
}

#[test]
fn hostile_behaviour_at_upload_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let up = |config: &str| {
        host.upload(
            "h",
            PolicyKind::Router,
            &wasm("hostile-router"),
            opts(config),
        )
        .unwrap_err()
    };
    for config in ["loop-always", "loop-inputs"] {
        let err = up(config);
        assert!(
            matches!(
                err,
                PolicyError::ValidationFailed {
                    kind: FailureKind::Timeout,
                    ..
                }
            ),
            "{config}: {err}"
        );
        assert_eq!(common::status(&err), 422);
    }
    let err = up("fail-init");
    assert!(
        matches!(err, PolicyError::InitRejected(ref m) if m.contains("fail-init")),
        "{err}"
    );
    let err = up("oom-init");
    assert!(
        matches!(
            err,
            PolicyError::ValidationFailed {
                kind: FailureKind::MemoryLimit,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        host.list().is_empty(),
        "nothing stored after refused uploads"
    );
    // The host is fine afterwards.
    upload(&host, "good", PolicyKind::Router, "alias-router", "");
}

#[test]
fn dataset_runaway_records_only_fail_themselves() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let limits = Limits {
        fuel: Some(5_000_000),
        memory_bytes: 16 << 20,
        ..PolicyKind::DatasetTransform.default_limits()
    };
    host.upload(
        "ht",
        PolicyKind::DatasetTransform,
        &wasm("hostile-transform"),
        PolicyOptions {
            limits: Some(limits),
            ..PolicyOptions::default()
        },
    )
    .unwrap();
    let recs = strings(&["\"a\"", "\"spin\"", "\"b\"", "\"oom\"", "\"c\""]);
    let out = host.transform_batch("ht", &recs).unwrap();
    assert_eq!(out[0], RecordOutcome::Keep("\"a\"".into()));
    assert!(
        matches!(&out[1], RecordOutcome::Error(m) if m.contains("out_of_fuel")),
        "{:?}",
        out[1]
    );
    assert_eq!(out[2], RecordOutcome::Keep("\"b\"".into()));
    assert!(
        matches!(&out[3], RecordOutcome::Error(m) if m.contains("memory_limit")),
        "{:?}",
        out[3]
    );
    assert_eq!(out[4], RecordOutcome::Keep("\"c\"".into()));

    // Deterministic: the same input fails the same way.
    assert_eq!(host.transform_batch("ht", &recs).unwrap(), out);

    // A wrong outcome count fails the batch; records are retried alone.
    let out = host
        .transform_batch("ht", &strings(&["\"x\"", "\"short\""]))
        .unwrap();
    assert_eq!(out[0], RecordOutcome::Keep("\"x\"".into()));
    assert!(
        matches!(&out[1], RecordOutcome::Error(m) if m.contains("bad_output")),
        "{:?}",
        out[1]
    );

    // Wrong kind of call.
    assert!(matches!(
        host.route_with("ht", &facts("m"), &[]),
        Err(PolicyError::KindMismatch { .. })
    ));
}

#[test]
fn upload_validation_errors_are_distinct() {
    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let router = PolicyKind::Router;
    let up = |name: &str, kind, bytes: &[u8]| {
        host.upload(name, kind, bytes, PolicyOptions::default())
            .unwrap_err()
    };

    let e = up("x", router, b"definitely not wasm");
    assert!(matches!(e, PolicyError::NotWasm(_)), "{e}");
    assert_eq!(common::status(&e), 400);
    let e = up("x", router, b"");
    assert!(matches!(e, PolicyError::NotWasm(_)), "{e}");
    // The smallest core module: magic + version 1.
    let e = up("x", router, b"\0asm\x01\0\0\0");
    assert!(matches!(e, PolicyError::CoreModule), "{e}");
    assert!(e.to_string().contains("wasm-component-ld"));
    let good = wasm("alias-router");
    let e = up("x", router, &good[..good.len() / 2]);
    assert!(matches!(e, PolicyError::Malformed(_)), "{e}");
    assert_eq!(common::status(&e), 400);

    let e = up("x", router, &wasm("alpaca-to-chat"));
    assert!(
        matches!(
            e,
            PolicyError::WrongKind {
                expected: PolicyKind::Router,
                found_kind: PolicyKind::DatasetTransform,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(common::status(&e), 422);
    let e = up("x", PolicyKind::DatasetTransform, &good);
    assert!(matches!(e, PolicyError::WrongKind { .. }), "{e}");
    let e = up("x", router, &wasm("wrong-version"));
    assert!(
        matches!(e, PolicyError::IncompatibleVersion { ref found, .. } if found.ends_with("@0.1.0")),
        "{e}"
    );

    // Another patch release of the interface is compatible: a component
    // built for 0.3.0 (no `backend-stats` or `request-control` import) on
    // this 0.3.3 host.
    let info = host
        .upload(
            "patch",
            router,
            &wasm("patch-version"),
            PolicyOptions {
                limits: Some(Limits {
                    deadline_ms: 200,
                    ..router.default_limits()
                }),
                ..PolicyOptions::default()
            },
        )
        .expect("0.3.0 accepted");
    assert_eq!(info.interface, "mlxgate:policy/router@0.3.0");
    assert_eq!(
        host.route_with("patch", &facts("m"), &[]).unwrap(),
        RouteDecision::local("m")
    );
    host.remove("patch").unwrap();

    // A wasip2 build imports WASI; the sandbox provides nothing.
    let e = up("x", router, &wasm_for("wasm32-wasip2", "wasi-imports"));
    assert!(
        matches!(e, PolicyError::UnsatisfiedImports(ref m) if m.contains("wasi:")),
        "{e}"
    );
    assert_eq!(e.code(), "unsatisfied_imports");

    let e = up("../etc", router, &good);
    assert!(matches!(e, PolicyError::InvalidName(_)), "{e}");
    let e = host
        .upload(
            "x",
            router,
            &good,
            PolicyOptions {
                limits: Some(Limits {
                    memory_bytes: 1 << 40,
                    ..router.default_limits()
                }),
                ..PolicyOptions::default()
            },
        )
        .unwrap_err();
    assert!(matches!(e, PolicyError::InvalidLimits(_)), "{e}");
    let e = host
        .upload("x", router, &good, opts(&"x".repeat(2 << 20)))
        .unwrap_err();
    assert!(matches!(e, PolicyError::ConfigTooLarge { .. }), "{e}");
    assert_eq!(common::status(&e), 413);
    assert!(host.list().is_empty());
}
