//! Durability (a new host on the same data dir reloads policies, bindings and
//! precompiled artifacts) and atomic swaps under concurrent calls. Needs
//! `scripts/build-policies.sh` to have run.

#[path = "policy_common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use mlxgate::policy::{Limits, LoadOrigin, OnError, PolicyKind, PolicyOptions, RouteDecision};
use serde_json::json;

#[test]
fn restart_reloads_policies_bindings_and_artifacts() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = json!({"aliases": {"gpt-4o": "llama"}}).to_string();
    {
        let host = common::host(dir.path());
        host.upload(
            "alias",
            PolicyKind::Router,
            &wasm("alias-router"),
            PolicyOptions {
                on_error: OnError::FailClosed,
                config: Some(cfg.clone()),
                limits: Some(Limits {
                    deadline_ms: 200,
                    ..PolicyKind::Router.default_limits()
                }),
            },
        )
        .unwrap();
        host.bind(PolicyKind::Router, "alias").unwrap();
        upload(
            &host,
            "clean",
            PolicyKind::DatasetTransform,
            "dataset-clean",
            "",
        );
        assert_eq!(host.get("alias").unwrap().origin, LoadOrigin::Uploaded);
    }

    let host = common::host(dir.path());
    assert!(host.load_errors().is_empty(), "{:?}", host.load_errors());
    let info = host.get("alias").unwrap();
    assert_eq!(
        info.origin,
        LoadOrigin::Artifact,
        "precompiled artifact reused"
    );
    assert_eq!(info.on_error, OnError::FailClosed);
    assert_eq!(info.limits.deadline_ms, 200);
    assert_eq!(info.config.as_deref(), Some(cfg.as_str()));
    assert_eq!(info.bound_as, vec![PolicyKind::Router]);
    assert_eq!(
        host.route(&facts("gpt-4o"), &[local("llama", 0, 0)])
            .unwrap(),
        RouteDecision::local("llama")
    );
    assert_eq!(host.list().len(), 2);
    drop(host);

    // A corrupt artifact is not deserialized: the host recompiles from the
    // stored component bytes.
    let artifacts = dir.path().join("policies/artifacts");
    for entry in std::fs::read_dir(&artifacts).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "cwasm") {
            let mut bytes = std::fs::read(&path).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0xff;
            std::fs::write(&path, bytes).unwrap();
        }
    }
    let host = common::host(dir.path());
    assert_eq!(host.get("alias").unwrap().origin, LoadOrigin::Recompiled);
    assert!(
        host.route(&facts("gpt-4o"), &[local("llama", 0, 0)])
            .is_ok()
    );
    drop(host);
    let host = common::host(dir.path());
    assert_eq!(
        host.get("alias").unwrap().origin,
        LoadOrigin::Artifact,
        "rewritten artifact"
    );

    // Removal is durable too, and frees the stored bytes.
    host.unbind(PolicyKind::Router).unwrap();
    host.remove("alias").unwrap();
    drop(host);
    let host = common::host(dir.path());
    assert_eq!(host.list().len(), 1);
    assert_eq!(host.binding(PolicyKind::Router), None);
    assert_eq!(
        std::fs::read_dir(dir.path().join("policies/blobs"))
            .unwrap()
            .count(),
        1
    );
}

#[test]
fn swaps_are_atomic_under_concurrent_calls() {
    let dir = tempfile::tempdir().unwrap();
    let host = Arc::new(host(dir.path()));
    let config_for =
        |target: &str| json!({"aliases": {"m": target}, "models": ["a", "b"]}).to_string();
    // A roomy deadline: this test is about atomicity, and compiling new
    // versions on a 2-core machine can starve the calling threads.
    let up = |target: &str| {
        let limits = Limits {
            deadline_ms: 500,
            ..PolicyKind::Router.default_limits()
        };
        host.upload(
            "r",
            PolicyKind::Router,
            &wasm("alias-router"),
            PolicyOptions {
                limits: Some(limits),
                config: Some(config_for(target)),
                ..PolicyOptions::default()
            },
        )
        .unwrap();
    };
    up("a");
    host.bind(PolicyKind::Router, "r").unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let host = host.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match host.route(&facts("m"), &[]) {
                        Ok(RouteDecision::Local { model, .. }) => seen.push(model),
                        other => panic!("call failed during swap: {other:?}"),
                    }
                }
                seen
            })
        })
        .collect();
    for i in 0..6 {
        let target = if i % 2 == 0 { "b" } else { "a" };
        up(target);
        let now = host.route(&facts("m"), &[]).unwrap();
        assert_eq!(
            now,
            RouteDecision::local(target),
            "new version serves at once"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let seen = w.join().expect("worker");
        assert!(seen.iter().all(|m| m == "a" || m == "b"));
    }
    let info = host.get("r").unwrap();
    assert_eq!(info.version, 7);
    assert_eq!(info.bound_as, vec![PolicyKind::Router]);
}
