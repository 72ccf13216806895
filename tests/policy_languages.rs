//! Policies written in Python (guest-sdk/python, componentize-py) and in
//! JavaScript (guest-sdk/js, componentize-js), built by
//! `scripts/build-policies.sh`, run by the real gateway. For each language:
//! its alpaca-to-chat gives exactly the Rust one's outcomes; a three-step
//! pipeline (the Rust dataset-clean guest, its alpaca-to-chat, the built-in
//! dedupe) over messy records; its tenant router decides requests; a guest
//! that loops forever or allocates without end (a memory bomb) is stopped
//! and reported, and the gateway keeps serving; its adapter-by-tenant
//! selects what the Rust one selects.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "policy_common/mod.rs"]
mod policy_common;
#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// A guest built from `policies/<language>/<name>`.
fn guest(language: &str, name: &str) -> Vec<u8> {
    let path = support::workspace_root().join(format!("policies/target/{language}/{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{} is missing ({e}): run scripts/setup.sh --tests, then scripts/build-policies.sh",
            path.display()
        )
    })
}

fn preview(addr: std::net::SocketAddr, body: Value) -> Value {
    let r = call(addr, "POST", "/api/datasets/preview", ADMIN, Some(&body));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// One language after the other: each upload compiles an interpreter
/// (seconds of both cores), so running them side by side only makes each
/// slower.
#[test]
fn python_and_javascript_guests_transform_route_and_are_contained() {
    guests_transform_route_and_are_contained("python");
    guests_transform_route_and_are_contained("js");
}

/// The Python and JavaScript adapter-by-tenant choose exactly what the Rust
/// one chooses, and refuse the same bad config.
#[test]
fn python_and_javascript_adapter_selectors_match_rust() {
    use mlxgate::policy::PolicyKind::AdapterSelector;
    use policy_common::{adapter, host, strings, tenant_facts, upload, upload_bytes};

    let dir = tempfile::tempdir().unwrap();
    let host = host(dir.path());
    let configs = [
        json!({"tenants": {"acme": ["acme-tone", "acme-sql", "acme-missing"]}}),
        json!({"tenants": {"acme": ["acme-sql"]}, "default": ["shared"]}),
    ];
    let mounted = [
        adapter("acme-sql", "llama"),
        adapter("acme-tone", "llama"),
        adapter("acme-other-base", "qwen"),
        adapter("shared", "llama"),
        adapter("ünï-cødé", "llama"),
    ];
    let asked = [
        tenant_facts("llama", Some("acme"), &[]),
        tenant_facts("qwen", Some("acme"), &[]),
        tenant_facts("llama", Some("globex"), &[]),
        tenant_facts("llama", None, &[("x-tenant", "acme")]),
        tenant_facts("mistral", Some("acme"), &[]),
    ];
    for (i, config) in configs.iter().enumerate() {
        let rust = format!("rust{i}");
        upload(
            &host,
            &rust,
            AdapterSelector,
            "adapter-by-tenant",
            &config.to_string(),
        );
        let expected: Vec<_> = asked
            .iter()
            .map(|f| host.select_adapters_with(&rust, f, &mounted).unwrap())
            .collect();
        // The cases tell apart: an ordered pick, none mounted, no opinion.
        let want_acme = if i == 0 {
            vec!["acme-tone", "acme-sql"]
        } else {
            vec!["acme-sql"]
        };
        assert_eq!(expected[0], Some(strings(&want_acme)));
        assert_eq!(expected[1], Some(vec![]));
        assert_eq!(expected[2].is_none(), i == 0);
        for language in ["python", "js"] {
            let name = format!("{language}{i}");
            let component = guest(language, "adapter_by_tenant");
            upload_bytes(
                &host,
                &name,
                AdapterSelector,
                &component,
                &config.to_string(),
            )
            .unwrap_or_else(|e| panic!("upload {name}: {e}"));
            for (f, want) in asked.iter().zip(&expected) {
                let got = host.select_adapters_with(&name, f, &mounted).unwrap();
                assert_eq!(
                    &got, want,
                    "{language}, config {config}, tenant {:?}",
                    f.tenant
                );
            }
        }
    }
    for language in ["python", "js"] {
        let err = upload_bytes(
            &host,
            "bad",
            AdapterSelector,
            &guest(language, "adapter_by_tenant"),
            r#"{"tenant": {}}"#,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("unknown field `tenant`"),
            "{language}: {err}"
        );
    }
}

fn guests_transform_route_and_are_contained(language: &str) {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    let info = put_policy(
        s.addr,
        "alpaca_py",
        "kind=dataset-transform",
        &guest(language, "alpaca_to_chat"),
    );
    assert_eq!(info["interface"], "mlxgate:policy/dataset-transform@0.3.3");
    put_policy(
        s.addr,
        "alpaca_rs",
        "kind=dataset-transform",
        &policy_common::wasm("alpaca-to-chat"),
    );
    put_policy(
        s.addr,
        "clean",
        "kind=dataset-transform",
        &policy_common::wasm("dataset-clean"),
    );

    // The same outcomes as the Rust guest, record for record.
    let mut records: Vec<Value> = (0..30)
        .map(|i| json!({"instruction": format!("Ünïcode task {i} \"quoted\""), "input": if i % 2 == 0 { "".to_owned() } else { format!("ctx {i}") }, "output": format!("answer {i}")}))
        .collect();
    records.push(json!({"output": "no instruction"}));
    records.push(json!({"instruction": "no output"}));
    records.push(json!([1, 2]));
    let py = preview(
        s.addr,
        json!({"transform": "alpaca_py", "records": records}),
    );
    let rs = preview(
        s.addr,
        json!({"transform": "alpaca_rs", "records": records}),
    );
    let strip = |v: &Value| -> Vec<Value> {
        v["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| json!([r["outcome"], r["output"], r["reason"]]))
            .collect()
    };
    assert_eq!(
        py["counts"],
        json!({"keep": 30, "drop": 0, "error": 3}),
        "{py}"
    );
    let (p, r) = (strip(&py), strip(&rs));
    assert_eq!(
        p[..31],
        r[..31],
        "the Python guest's outcomes differ from the Rust one's"
    );

    // A pipeline of a Rust guest, a Python guest and the built-in dedupe,
    // over records that are duplicates only once their whitespace is cleaned.
    let input = root.path().join("messy.jsonl");
    let lines: Vec<String> = (0..40)
        .map(|i| {
            let q = i % 25;
            let pad = if i >= 25 { "   " } else { "" };
            json!({"instruction": format!("{pad}What is {q}?\t\t"), "input": "", "output": format!("It is\r\n{q}.{pad}")}).to_string()
        })
        .chain([json!({"instruction": "   ", "output": ""}).to_string()])
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = root.path().join("chat");
    let row = submit_ok(
        s.addr,
        "dataset",
        json!({"input": input.display().to_string(), "output_dir": out.display().to_string(),
               "steps": [{"policy": "clean"}, {"policy": "alpaca_py"}, {"dedupe": ["messages"]}]}),
    );
    let row = wait_final(
        s.addr,
        row["id"].as_str().unwrap(),
        Duration::from_secs(120),
    );
    assert_eq!(row["status"], "done", "{row}");
    let sum = &row["summary"];
    // 25 distinct questions kept; 15 repeats dropped by dedupe; the blank
    // record dropped by the cleaner.
    assert_eq!(
        (sum["kept"].as_u64(), sum["dropped"].as_u64()),
        (Some(25), Some(16)),
        "{sum}"
    );
    let train: Vec<Value> = std::fs::read_to_string(out.join("train.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        train[3],
        json!({"messages": [{"role": "user", "content": "What is 3?"}, {"role": "assistant", "content": "It is\n3."}]})
    );
    let rejected = std::fs::read_to_string(out.join("rejected.jsonl")).unwrap();
    assert_eq!(rejected.matches("\"step\":\"dedupe\"").count(), 15);
    assert_eq!(rejected.matches("\"step\":\"policy clean\"").count(), 1);

    // A guest that spins or hogs memory: stopped, reported, the rest served.
    put_policy(
        s.addr,
        "hostile_py",
        "kind=dataset-transform&deadline_ms=1000",
        &guest(language, "spin_or_hog"),
    );
    let v = preview(
        s.addr,
        json!({"transform": "hostile_py", "records": [{"a": "fine"}, {"a": "spin"}, {"a": "hog"}, {"a": "also fine"}]}),
    );
    let outcomes: Vec<(&str, &str)> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["outcome"].as_str().unwrap(),
                r["reason"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(outcomes[0], ("keep", ""), "{v}");
    assert_eq!(outcomes[3], ("keep", ""), "{v}");
    assert_eq!(outcomes[1].0, "error");
    assert!(
        outcomes[1].1.contains("out_of_fuel") || outcomes[1].1.contains("timeout"),
        "{v}"
    );
    assert!(outcomes[2].1.contains("memory_limit"), "{v}");
    assert_eq!(s.get("/healthz").status, 200);
    let again = preview(
        s.addr,
        json!({"transform": "alpaca_py", "records": [{"instruction": "a", "output": "b"}]}),
    );
    assert_eq!(again["counts"]["keep"], 1);

    // The Python tenant router decides requests.
    let config = "%7B%22tenants%22%3A%7B%22t%22%3A%7B%22deny%22%3A%5B%22gpt-4o%22%5D%7D%7D%7D";
    put_policy(
        s.addr,
        "tenants_py",
        // A deadline that a loaded CI machine cannot miss (5 ms by default).
        &format!("kind=router&deadline_ms=1000&on_error=fail_closed&config={config}"),
        &guest(language, "tenant_router"),
    );
    let r = call(
        s.addr,
        "PUT",
        "/admin/bindings/router",
        ADMIN,
        Some(&json!({"policy": "tenants_py"})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let chat = |key: &str, model: &str| {
        call(
            s.addr,
            "POST",
            "/v1/chat/completions",
            key,
            Some(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})),
        )
    };
    // The key with a tenant asks for a denied model; the admin key has none.
    for (key, why) in [
        (INFER, "not allowed for this tenant"),
        (ADMIN, "unknown tenant"),
    ] {
        let refused = chat(key, "gpt-4o");
        assert_eq!(refused.status, 403, "{}", refused.text());
        assert!(refused.text().contains(why), "{}", refused.text());
    }
    let info = call(s.addr, "GET", "/admin/policies/tenants_py", ADMIN, None).json();
    assert!(info["metrics"]["calls"].as_u64().unwrap() >= 2, "{info}");
}
