//! `dataset` jobs through the real gateway with the example policies
//! (`scripts/build-policies.sh`): alpaca-to-chat with a train/valid split,
//! and dataset-clean dropping empty records, with rejects and metrics.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "policy_common/mod.rs"]
mod policy_common;
#[path = "support/mod.rs"]
mod support;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn upload(addr: std::net::SocketAddr, name: &str, crate_name: &str) {
    let wasm = policy_common::wasm(crate_name);
    put_policy(addr, name, "kind=dataset-transform&deadline_ms=500", &wasm);
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn alpaca_to_chat_with_a_split_and_rejects() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    upload(s.addr, "alpaca", "alpaca-to-chat");
    let input = root.path().join("alpaca.jsonl");
    let mut lines = Vec::new();
    for i in 0..40 {
        let input = if i % 2 == 0 {
            String::new()
        } else {
            format!("context {i}")
        };
        lines.push(json!({"instruction": format!("task {i}"), "input": input, "output": format!("answer {i}")}).to_string());
    }
    lines.insert(5, r#"{"instruction": "no output"}"#.to_owned());
    lines.insert(9, "{not json".to_owned());
    lines.insert(12, String::new()); // blank lines are skipped
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = root.path().join("out/chat");

    let cfg = json!({
        "input": input.display().to_string(),
        "output_dir": out.display().to_string(),
        "policy": "alpaca",
        "batch_size": 8,
        "valid_ratio": 0.25,
        "seed": 42,
    });
    let row = submit_ok(s.addr, "dataset", cfg.clone());
    let id = row["id"].as_str().unwrap().to_owned();
    let row = wait_final(s.addr, &id, T);
    assert_eq!(row["status"], "done", "{row}");
    assert_eq!(row["output_path"], out.display().to_string());
    let sum = &row["summary"];
    assert_eq!(sum["records"], 42);
    assert_eq!(sum["kept"], 40);
    assert_eq!(sum["errors"], 2);
    assert_eq!(sum["dropped"], 0);

    let train = jsonl(&out.join("train.jsonl"));
    let valid = jsonl(&out.join("valid.jsonl"));
    assert_eq!(train.len() + valid.len(), 40);
    assert!(!valid.is_empty() && valid.len() < 20, "{}", valid.len());
    assert_eq!(sum["valid"], valid.len());
    for rec in train.iter().chain(&valid) {
        let m = rec["messages"].as_array().unwrap();
        assert_eq!(m[0]["role"], "user");
        assert_eq!(m[1]["role"], "assistant");
    }
    let first = &train[0]["messages"];
    assert_eq!(first[0]["content"], "task 0");
    let rejected = jsonl(&out.join("rejected.jsonl"));
    assert_eq!(rejected.len(), 2);
    assert_eq!(rejected[0]["line"], 6);
    assert_eq!(rejected[0]["outcome"], "error");
    assert!(rejected[0]["reason"].as_str().unwrap().contains("output"));
    assert_eq!(rejected[1]["line"], 10);
    assert!(rejected[1]["reason"].as_str().unwrap().contains("JSON"));
    assert!(!out.join("train.jsonl.partial").exists());

    // Progress metrics (about two a second, and one at the end) with the
    // counts, the rate, and progress ending at 1.
    let ev = parse_sse(
        &call(
            s.addr,
            "GET",
            &format!("/api/jobs/{id}/events"),
            ADMIN,
            None,
        )
        .text(),
    );
    let metrics: Vec<&Value> = ev
        .iter()
        .map(|e| &e.1)
        .filter(|e| e["type"] == "metric")
        .collect();
    assert!(!metrics.is_empty());
    assert!(metrics.last().unwrap()["records_per_sec"].as_f64().unwrap() > 0.0);
    assert_eq!(metrics.last().unwrap()["kind"], "dataset");
    assert_eq!(metrics.last().unwrap()["kept"], 40);
    assert_eq!(metrics.last().unwrap()["progress"], 1.0);

    // Same seed, same split.
    let again = root.path().join("out/again");
    let mut cfg2 = cfg;
    cfg2["output_dir"] = json!(again.display().to_string());
    let row = submit_ok(s.addr, "dataset", cfg2);
    assert_eq!(
        wait_final(s.addr, row["id"].as_str().unwrap(), T)["status"],
        "done"
    );
    assert_eq!(
        std::fs::read(again.join("valid.jsonl")).unwrap(),
        std::fs::read(out.join("valid.jsonl")).unwrap()
    );
}

#[test]
fn cleaning_drops_empty_records_and_refuses_wrong_policies() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    upload(s.addr, "clean", "dataset-clean");
    let input = root.path().join("raw.jsonl");
    let records = [
        json!({"text": "  hello \t  world  "}),
        json!({"text": "   "}),
        json!({"text": "keep\r\nme"}),
        json!({"text": ""}),
    ];
    let text: String = records.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&input, text).unwrap();
    let out = root.path().join("clean");
    let row = submit_ok(
        s.addr,
        "dataset",
        json!({"input": input.display().to_string(), "output_dir": out.display().to_string(), "policy": "clean", "batch_size": 3}),
    );
    let row = wait_final(s.addr, row["id"].as_str().unwrap(), T);
    assert_eq!(row["status"], "done", "{row}");
    let train = jsonl(&out.join("train.jsonl"));
    assert_eq!(
        train,
        vec![json!({"text": "hello world"}), json!({"text": "keep\nme"})]
    );
    assert!(!out.join("valid.jsonl").exists());
    let rejected = jsonl(&out.join("rejected.jsonl"));
    assert_eq!(rejected.len(), 2);
    assert!(
        rejected
            .iter()
            .all(|r| r["outcome"] == "drop" && r["reason"] == "empty")
    );
    assert_eq!(row["summary"]["dropped"], 2);

    // Unknown policy, or a policy of another kind: 400 on config.policy.
    let cfg = |policy: &str| json!({"input": input.display().to_string(), "output_dir": out.display().to_string(), "policy": policy});
    let r = submit(s.addr, ADMIN, "dataset", cfg("missing"));
    assert_eq!(
        r.api_error(400, "invalid_request_error", "invalid_request")["param"],
        "config.policy"
    );
    let router = policy_common::wasm("alias-router");
    let r = support::try_request(
        s.addr,
        "PUT",
        "/admin/policies/router?kind=router",
        &[("authorization", &auth(ADMIN))],
        Some(&router),
    )
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    let r = submit(s.addr, ADMIN, "dataset", cfg("router"));
    assert_eq!(r.json()["error"]["param"], "config.policy");
    let r = submit(
        s.addr,
        ADMIN,
        "dataset",
        json!({"input": input.display().to_string(), "output_dir": out.display().to_string(), "policy": "clean", "valid_ratio": 1.5}),
    );
    assert_eq!(r.json()["error"]["param"], "config.valid_ratio");
}
