//! The policy admin API over real HTTP, `/metrics`, and the `mlxgate policy`
//! and `mlxgate dataset transform` commands, against the real binary. Needs
//! `scripts/build-policies.sh` to have run.

#[path = "policy_common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use std::path::PathBuf;

use common::wasm;
use support::{ServerBuilder, run_cli};

const KEY: &str = "policy-admin-test-key";
const AUTH: (&str, &str) = ("authorization", "Bearer policy-admin-test-key");

fn wasm_path(crate_name: &str) -> String {
    let _ = wasm(crate_name); // fails with the build hint when missing
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../policies/target/wasm32-unknown-unknown/release")
        .join(format!("{}.wasm", crate_name.replace('-', "_")))
        .display()
        .to_string()
}

#[test]
fn admin_api_uploads_binds_lists_and_removes() {
    let server = ServerBuilder::new().env("MLXGATE_ADMIN_KEY", KEY).start();
    let alias = wasm("alias-router");
    let put = |path: &str, body: &[u8]| server.request("PUT", path, &[AUTH], Some(body));

    // Admin scope required.
    let r = server.request(
        "PUT",
        "/admin/policies/alias?kind=router",
        &[],
        Some(&alias),
    );
    assert_eq!(r.status, 401);

    let cfg = "%7B%22aliases%22%3A%7B%22gpt-4o%22%3A%22llama%22%7D%7D";
    let r = put(
        &format!("/admin/policies/alias?kind=router&on_error=fail_closed&config={cfg}"),
        &alias,
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["kind"], "router");
    assert_eq!(v["version"], 1);
    assert_eq!(v["on_error"], "fail_closed");
    assert_eq!(v["config"], r#"{"aliases":{"gpt-4o":"llama"}}"#);
    assert_eq!(v["interface"], "mlxgate:policy/router@0.3.3");
    let r = put(
        "/admin/policies/alias?kind=router&deadline_ms=20&memory_mb=8",
        &alias,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["version"], 2);
    assert_eq!(r.json()["limits"]["deadline_ms"], 20);

    // Validation errors keep the OpenAI error shape, with distinct codes.
    let r = put("/admin/policies/bad?kind=router", b"\0asm\x01\0\0\0");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "core_module");
    let r = put("/admin/policies/bad?kind=router", &wasm("wrong-version"));
    assert_eq!(r.status, 422);
    assert_eq!(r.json()["error"]["code"], "incompatible_version");
    let r = put("/admin/policies/bad?kind=nope", &alias);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "kind");
    let r = put("/admin/policies/bad", &alias);
    assert_eq!(r.status, 400);

    let r = server.request("GET", "/admin/policies", &[AUTH], None);
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    assert_eq!(v["data"][0]["name"], "alias");

    let r = put("/admin/bindings/router", br#"{"policy": "alias"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = put(
        "/admin/bindings/dataset-transform",
        br#"{"policy": "alias"}"#,
    );
    assert_eq!(r.status, 400);
    let r = server.request("GET", "/admin/policies/alias", &[AUTH], None);
    assert_eq!(r.json()["bound_as"][0], "router");
    assert_eq!(r.json()["metrics"]["calls"], 0);

    let metrics = server.get("/metrics").text();
    assert!(
        metrics.contains("mlxgate_policy_calls_total{policy=\"alias\",kind=\"router\"} 0"),
        "{metrics}"
    );

    let r = server.request("DELETE", "/admin/policies/alias", &[AUTH], None);
    assert_eq!(r.status, 409);
    assert_eq!(r.json()["error"]["code"], "in_use");
    put("/admin/bindings/router", br#"{"policy": null}"#);
    let r = server.request("DELETE", "/admin/policies/alias", &[AUTH], None);
    assert_eq!(r.status, 200);
    let r = server.request("GET", "/admin/policies/alias", &[AUTH], None);
    assert_eq!(r.status, 404);
}

#[test]
fn policy_cli_talks_to_the_running_gateway() {
    let server = ServerBuilder::new().env("MLXGATE_ADMIN_KEY", KEY).start();
    let url = format!("http://{}", server.addr);
    let env = [("MLXGATE_ADMIN_KEY", KEY), ("MLXGATE_URL", url.as_str())];
    let cli = |args: &[&str]| {
        let (status, out, err) = run_cli(args, &env);
        assert!(status.success(), "{args:?}: {err}");
        out
    };
    let path = wasm_path("least-loaded");
    let out = cli(&[
        "policy", "push", "ll", &path, "--kind", "router", "--config", "{}",
    ]);
    assert!(out.contains("pushed ll (router, version 1"), "{out}");
    cli(&["policy", "bind", "router", "ll"]);
    let out = cli(&["policy", "list"]);
    assert!(
        out.contains("ll") && out.contains("bindings: router=ll"),
        "{out}"
    );
    let (status, _, err) = run_cli(&["policy", "rm", "ll"], &env);
    assert!(!status.success() && err.contains("409"), "{err}");
    cli(&["policy", "bind", "router", "--none"]);
    cli(&["policy", "rm", "ll"]);
    assert!(cli(&["policy", "list"]).contains("bindings: router=-"));
    // Wrong key: the gateway's refusal is shown.
    let (status, _, err) = run_cli(
        &["policy", "list"],
        &[
            ("MLXGATE_ADMIN_KEY", "wrong"),
            ("MLXGATE_URL", url.as_str()),
        ],
    );
    assert!(!status.success() && err.contains("401"), "{err}");
}

#[test]
fn dataset_transform_cli_runs_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let data = data.to_str().unwrap();
    let (status, _, err) = run_cli(
        &[
            "policy",
            "push",
            "a2c",
            &wasm_path("alpaca-to-chat"),
            "--kind",
            "dataset-transform",
            "--data-dir",
            data,
        ],
        &[],
    );
    assert!(status.success(), "{err}");
    let input = dir.path().join("in.jsonl");
    let mut text = String::new();
    for i in 0..100 {
        text.push_str(&format!(
            "{{\"instruction\": \"q{i}\", \"input\": \"\", \"output\": \"a{i}\"}}\n"
        ));
    }
    text.push_str("{\"instruction\": \"no output\"}\n\n");
    text.push_str("not json\n");
    std::fs::write(&input, text).unwrap();
    let output = dir.path().join("out.jsonl");
    let rejects = dir.path().join("rejects.jsonl");
    let (status, _, err) = run_cli(
        &[
            "dataset",
            "transform",
            "--policy",
            "a2c",
            input.to_str().unwrap(),
            output.to_str().unwrap(),
            "--rejects",
            rejects.to_str().unwrap(),
            "--batch",
            "16",
        ],
        &[("MLXGATE_DATA_DIR", data)],
    );
    assert!(status.success(), "{err}");
    assert!(
        err.contains("done: 102 records") && err.contains("100 kept") && err.contains("2 errors"),
        "{err}"
    );
    let out = std::fs::read_to_string(&output).unwrap();
    let lines: Vec<_> = out.lines().collect();
    assert_eq!(lines.len(), 100);
    let first: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(first["messages"][0]["content"], "q0");
    let rej = std::fs::read_to_string(&rejects).unwrap();
    let rej: Vec<serde_json::Value> = rej
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rej.len(), 2);
    assert_eq!(rej[0]["line"], 101);
    assert_eq!(rej[1]["line"], 103);
}
