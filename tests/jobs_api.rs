//! The jobs API over real HTTP against the real binary: submit, list with
//! filters and pages, events (replay, live follow, resume), cancel, crash
//! jobs, config errors naming the field, scopes, and the `mlxgate jobs` CLI.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use support::run_cli;

const T: Duration = Duration::from_secs(30);

fn ids(v: &Value) -> Vec<String> {
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn submit_list_filter_paginate_and_get() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "enable_crash = true");
    let mut noops = Vec::new();
    for _ in 0..5 {
        let row = submit_ok(s.addr, "noop", json!({"steps": 1, "delay_ms": 0}));
        assert_eq!(row["kind"], "noop");
        assert!(
            matches!(row["status"].as_str(), Some("queued" | "running")),
            "{row}"
        );
        assert!(row["log_path"].as_str().unwrap().ends_with(".ndjson"));
        noops.push(row["id"].as_str().unwrap().to_owned());
    }
    let crash = submit_ok(s.addr, "crash", json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    for id in noops.iter().chain([&crash]) {
        wait_final(s.addr, id, T);
    }
    let done = get_job(s.addr, &noops[0]);
    assert_eq!(done["status"], "done");
    assert_eq!(done["progress"], 1.0);
    assert!(done["started_at"].is_string() && done["ended_at"].is_string());
    assert_eq!(done["submitted_by"], "admin");

    // Newest first, in pages.
    let list = |q: &str| {
        let r = call(s.addr, "GET", &format!("/api/jobs{q}"), ADMIN, None);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let p1 = list("?limit=4");
    let mut want: Vec<String> = noops.iter().chain([&crash]).cloned().collect();
    want.reverse();
    assert_eq!(ids(&p1), want[..4]);
    let cursor = p1["next_cursor"].as_str().unwrap().to_owned();
    let p2 = list(&format!("?limit=4&cursor={cursor}"));
    assert_eq!(ids(&p2), want[4..]);
    assert!(p2["next_cursor"].is_null());

    assert_eq!(ids(&list("?kind=crash")), vec![crash.clone()]);
    assert_eq!(ids(&list("?status=failed")), vec![crash.clone()]);
    assert_eq!(ids(&list("?status=done&kind=noop&limit=2")).len(), 2);
    assert!(ids(&list("?status=running")).is_empty());

    let r = call(s.addr, "GET", "/api/jobs?status=sleeping", ADMIN, None);
    assert_eq!(
        r.api_error(400, "invalid_request_error", "invalid_request")["param"],
        "status"
    );
    let r = call(s.addr, "GET", "/api/jobs?limit=0", ADMIN, None);
    assert_eq!(r.json()["error"]["param"], "limit");
    let r = call(s.addr, "GET", "/api/jobs/job-999999999999", ADMIN, None);
    r.api_error(404, "not_found_error", "job_not_found");
}

#[test]
fn events_replay_follow_live_and_resume() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    let row = submit_ok(s.addr, "noop", json!({"steps": 6, "delay_ms": 150}));
    let id = row["id"].as_str().unwrap();
    let path = format!("/api/jobs/{id}/events");

    // Live: the first events arrive while the job is still running.
    let mut live = SseStream::open(s.addr, &path, ADMIN, &[]);
    let (first_id, first) = live.next_event().expect("an event");
    assert_eq!(first_id, 1);
    assert_eq!(first["type"], "started");
    assert_eq!(first["seq"], 1);
    assert!(first["ts"].is_number());
    let (_, second) = live.next_event().expect("a second event");
    assert_ne!(second["type"], "done");
    assert_eq!(get_job(s.addr, id)["status"], "running");
    let mut events = vec![(first_id, first), (1, second)];
    events.extend(live.collect_rest());
    let last = &events.last().unwrap().1;
    assert_eq!(last["type"], "done", "{events:?}");
    assert_eq!(last["summary"]["steps"], 6);
    let stages: Vec<&Value> = events
        .iter()
        .map(|e| &e.1)
        .filter(|e| e["type"] == "stage")
        .collect();
    assert_eq!(stages.len(), 7);
    assert_eq!(stages.last().unwrap()["progress"], 1.0);
    let metrics = events.iter().filter(|e| e.1["type"] == "metric").count();
    assert_eq!(metrics, 6);
    // The row is final by the time its terminal event is sent.
    assert_eq!(get_job(s.addr, id)["status"], "done");

    // Replay of a finished job: the same events, in order, ids = seq.
    let r = call(s.addr, "GET", &path, ADMIN, None);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let replay = parse_sse(&r.text());
    let seqs: Vec<u64> = replay.iter().map(|e| e.0).collect();
    assert_eq!(seqs, (1..=replay.len() as u64).collect::<Vec<_>>());
    assert!(replay.iter().all(|(id, v)| v["seq"] == *id));
    assert_eq!(replay.len(), 1 + 7 + 6 + 1);
    assert_eq!(replay.last().unwrap().1["type"], "done");

    // Resume after an id, by header or query.
    let r = support::try_request(
        s.addr,
        "GET",
        &path,
        &[("authorization", &auth(ADMIN)), ("last-event-id", "3")],
        None,
    )
    .unwrap();
    let resumed = parse_sse(&r.text());
    assert_eq!(resumed[0].0, 4);
    assert_eq!(resumed.len(), replay.len() - 3);
    let r = call(s.addr, "GET", &format!("{path}?after=14"), ADMIN, None);
    assert_eq!(
        parse_sse(&r.text()).iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![15]
    );
    let r = support::try_request(
        s.addr,
        "GET",
        &path,
        &[("authorization", &auth(ADMIN)), ("last-event-id", "x")],
        None,
    )
    .unwrap();
    r.api_error(400, "invalid_request_error", "invalid_request");
    let r = call(
        s.addr,
        "GET",
        "/api/jobs/job-000000009999/events",
        ADMIN,
        None,
    );
    assert_eq!(r.status, 404);
}

#[test]
fn cancel_running_and_queued_jobs() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "concurrency = { noop = 1 }");
    let a = submit_ok(s.addr, "noop", json!({"steps": 1000, "delay_ms": 100}));
    let a = a["id"].as_str().unwrap();
    wait_job(s.addr, a, T, |r| r["status"] == "running");
    // Only one noop slot: B waits.
    let b = submit_ok(s.addr, "noop", json!({"steps": 1, "delay_ms": 0}));
    let b = b["id"].as_str().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(get_job(s.addr, b)["status"], "queued");

    let r = call(s.addr, "DELETE", &format!("/api/jobs/{b}"), ADMIN, None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "cancelled");
    let ev = parse_sse(&call(s.addr, "GET", &format!("/api/jobs/{b}/events"), ADMIN, None).text());
    assert_eq!(ev.last().unwrap().1["type"], "cancelled");

    let mut follower = SseStream::open(s.addr, &format!("/api/jobs/{a}/events"), ADMIN, &[]);
    // The worker key is another tenant's: for it the admin's job does not exist.
    let r = call(s.addr, "DELETE", &format!("/api/jobs/{a}"), WORKER, None);
    r.api_error(404, "not_found_error", "job_not_found");
    let r = call(s.addr, "DELETE", &format!("/api/jobs/{a}"), ADMIN, None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "cancelled");
    let rest = follower.collect_rest();
    assert_eq!(rest.last().unwrap().1["type"], "cancelled");

    let r = call(s.addr, "DELETE", &format!("/api/jobs/{a}"), ADMIN, None);
    r.api_error(409, "conflict_error", "job_finished");
    let r = call(s.addr, "DELETE", "/api/jobs/job-000000009999", ADMIN, None);
    assert_eq!(r.status, 404);
    // The slot is free again.
    let c = submit_ok(s.addr, "noop", json!({"steps": 1, "delay_ms": 0}));
    assert_eq!(
        wait_final(s.addr, c["id"].as_str().unwrap(), T)["status"],
        "done"
    );
}

#[test]
fn crash_jobs_fail_and_the_gateway_keeps_serving() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "enable_crash = true");
    let err = submit_ok(s.addr, "crash", json!({"mode": "error"}));
    let panic = submit_ok(s.addr, "crash", json!({"mode": "panic", "after_ms": 50}));
    let err = wait_final(s.addr, err["id"].as_str().unwrap(), T);
    assert_eq!(err["status"], "failed");
    assert!(
        err["error"].as_str().unwrap().contains("on purpose"),
        "{err}"
    );
    let panic = wait_final(s.addr, panic["id"].as_str().unwrap(), T);
    assert_eq!(panic["status"], "failed");
    assert!(
        panic["error"].as_str().unwrap().contains("panicked"),
        "{panic}"
    );
    let ev = parse_sse(
        &call(
            s.addr,
            "GET",
            &format!("/api/jobs/{}/events", panic["id"].as_str().unwrap()),
            ADMIN,
            None,
        )
        .text(),
    );
    let last = &ev.last().unwrap().1;
    assert_eq!(last["type"], "failed");
    assert!(last["error"].as_str().unwrap().contains("panicked"));

    assert_eq!(s.get("/healthz").status, 200);
    let ok = submit_ok(s.addr, "noop", json!({"steps": 2, "delay_ms": 1}));
    assert_eq!(
        wait_final(s.addr, ok["id"].as_str().unwrap(), T)["status"],
        "done"
    );
}

#[test]
fn bad_kinds_and_configs_are_400_naming_the_field() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    let param = |kind: Value, config: Value| {
        let r = call(
            s.addr,
            "POST",
            "/api/jobs",
            ADMIN,
            Some(&json!({"kind": kind, "config": config})),
        );
        let e = r.api_error(400, "invalid_request_error", "invalid_request");
        e["param"].as_str().unwrap().to_owned()
    };
    // Crash jobs are off unless the config enables them.
    assert_eq!(param(json!("crash"), json!({})), "kind");
    assert_eq!(param(json!("nope"), json!({})), "kind");
    assert_eq!(param(json!(7), json!({})), "kind");
    assert_eq!(param(json!("finetune"), json!({})), "config.model");
    assert_eq!(
        param(json!("noop"), json!({"steps": "many"})),
        "config.steps"
    );
    assert_eq!(param(json!("noop"), json!({"steps": -1})), "config.steps");
    assert_eq!(param(json!("noop"), json!({"bogus": 1})), "config.bogus");
    assert_eq!(param(json!("noop"), json!([1])), "config");
    let r = call(
        s.addr,
        "POST",
        "/api/jobs",
        ADMIN,
        Some(&json!({"config": {}})),
    );
    assert_eq!(r.json()["error"]["param"], "kind");
    let r = support::try_request(
        s.addr,
        "POST",
        "/api/jobs",
        &[("authorization", &auth(ADMIN))],
        Some(b"{not json"),
    )
    .unwrap();
    r.api_error(400, "invalid_request_error", "invalid_json");

    // Paths must stay inside the allowed folders.
    let inside = root.path().join("in.jsonl");
    std::fs::write(&inside, "{}\n").unwrap();
    let outside = tempfile::tempdir().unwrap();
    let out = root.path().join("out").display().to_string();
    let cfg = |input: String, output: String| json!({"input": input, "output_dir": output, "policy": "p"});
    assert_eq!(
        param(json!("dataset"), cfg("/etc/passwd".into(), out.clone())),
        "config.input"
    );
    assert_eq!(
        param(
            json!("dataset"),
            cfg(
                format!("{}/../in.jsonl", root.path().display()),
                out.clone()
            )
        ),
        "config.input"
    );
    assert_eq!(
        param(
            json!("dataset"),
            cfg(
                inside.display().to_string(),
                outside.path().display().to_string()
            )
        ),
        "config.output_dir"
    );
    assert_eq!(
        param(
            json!("dataset"),
            cfg(inside.display().to_string(), out.clone())
        ),
        "config.policy"
    );
    assert_eq!(
        param(
            json!("quantize"),
            json!({"input": root.path().display().to_string(), "output_dir": out})
        ),
        "config.input"
    );
    // Nothing was recorded for refused submissions.
    let r = call(s.addr, "GET", "/api/jobs", ADMIN, None);
    assert!(ids(&r.json()).is_empty());
}

#[test]
fn scopes_decide_who_submits_what() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    // The jobs scope submits noop jobs...
    let r = submit(s.addr, WORKER, "noop", json!({"steps": 0}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["submitted_by"], "worker");
    // ...but dataset/quantize need admin.
    for kind in ["dataset", "quantize", "finetune"] {
        let r = submit(s.addr, WORKER, kind, json!({}));
        let e = r.api_error(403, "permission_error", "insufficient_scope");
        assert!(e["message"].as_str().unwrap().contains("admin"), "{e}");
    }
    // Keys without the jobs scope, or no key, get nothing under /api/.
    let r = submit(s.addr, INFER, "noop", json!({}));
    r.api_error(403, "permission_error", "insufficient_scope");
    let r = call(s.addr, "GET", "/api/jobs", INFER, None);
    assert_eq!(r.status, 403);
    let r = support::try_request(s.addr, "GET", "/api/jobs", &[], None).unwrap();
    r.api_error(401, "invalid_request_error", "invalid_api_key");
    let r = call(s.addr, "GET", "/api/jobs", WORKER, None);
    assert_eq!(r.status, 200);
}

#[test]
fn cli_submits_watches_lists_and_cancels() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    let url = format!("http://{}", s.addr);
    let env = [("MLXGATE_API_KEY", WORKER), ("MLXGATE_URL", url.as_str())];
    let (st, out, err) = run_cli(
        &[
            "jobs",
            "submit",
            "noop",
            "--config",
            r#"{"steps": 3, "delay_ms": 30}"#,
        ],
        &env,
    );
    assert!(st.success(), "{err}");
    let row: Value = serde_json::from_str(&out).unwrap();
    let id = row["id"].as_str().unwrap().to_owned();

    let (st, out, err) = run_cli(&["jobs", "watch", &id], &env);
    assert!(st.success(), "{err}");
    let row: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(row["status"], "done");
    assert!(err.contains("step 100.0% step 3/3"), "{err}");

    let (st, out, _) = run_cli(&["jobs", "watch", &id, "--json"], &env);
    assert!(st.success());
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.first().unwrap()["type"], "started");
    assert_eq!(lines.last().unwrap()["type"], "done");

    let (st, out, _) = run_cli(&["jobs", "list", "--kind", "noop"], &env);
    assert!(st.success());
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["data"][0]["id"],
        id.as_str()
    );
    let (st, out, _) = run_cli(&["jobs", "show", &id], &env);
    assert!(st.success());
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["status"],
        "done"
    );

    let (st, _, err) = run_cli(&["jobs", "cancel", &id], &env);
    assert!(!st.success());
    assert!(err.contains("409") && err.contains("job_finished"), "{err}");

    let (st, out, _) = run_cli(
        &[
            "jobs",
            "submit",
            "noop",
            "--config",
            r#"{"steps": 1000, "delay_ms": 50}"#,
        ],
        &env,
    );
    assert!(st.success());
    let long: Value = serde_json::from_str(&out).unwrap();
    let long = long["id"].as_str().unwrap().to_owned();
    let (st, out, err) = run_cli(&["jobs", "cancel", &long], &env);
    assert!(st.success(), "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["status"],
        "cancelled"
    );
    let (st, _, err) = run_cli(&["jobs", "watch", &long], &env);
    assert!(!st.success());
    assert!(err.contains("cancelled"), "{err}");

    let (st, _, err) = run_cli(&["jobs", "submit", "dataset"], &env);
    assert!(!st.success());
    assert!(err.contains("403"), "{err}");
}
