//! The web console at `/console/`.
//!
//! Over plain HTTP: `/` sends browsers there, the page carries a strict
//! Content-Security-Policy that allows its import map by hash, files
//! revalidate by ETag, `/console/session` tells a key's scopes (401 for a
//! missing or unknown key), the admin API still refuses an infer-only key,
//! `POST /api/datasets/preview` runs a transform and names bad requests, and
//! `[console] enabled = false` removes the pages.
//!
//! In a real headless Chromium (Debian's, driven by Playwright through
//! `tests/console/e2e.cjs`): sign-in, a streamed chat answer, jobs submitted
//! from the forms reaching `done` with live events, a policy uploaded, bound
//! and counting calls, a bad upload's validation message, a fine-tune's loss
//! chart drawing points, and what an infer-only key may not see. The
//! screenshots land in `target/console-screenshots/`.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{ADMIN, INFER, auth, call};
use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};
use serde_json::{Value, json};
use support::{ServerBuilder, try_request, workspace_root};

fn wasm_path(crate_name: &str) -> PathBuf {
    let p = workspace_root().join(format!(
        "policies/target/wasm32-unknown-unknown/release/{crate_name}.wasm"
    ));
    assert!(
        p.is_file(),
        "{} is missing: run scripts/build-policies.sh first",
        p.display()
    );
    p
}

/// A gateway with the admin key (all scopes), a jobs-only and an
/// infer-only key, jobs allowed under `root`, and `extra` config lines.
fn server(root: &Path, model: Option<&Path>, extra: &str) -> support::Server {
    let config = common::config_toml(&format!(
        "allowed_paths = [{:?}]\n{extra}",
        root.display().to_string()
    ));
    let mut b = ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN);
    if let Some(m) = model {
        b = b.model(m);
    }
    b.start()
}

#[test]
fn console_pages_session_and_preview_over_http() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), None, "");

    // `/` and `/console` send a browser to the console.
    for path in ["/", "/console"] {
        let r = s.get(path);
        assert_eq!(r.status, 302, "{path}");
        assert_eq!(r.header("location"), Some("/console/"), "{path}");
    }
    let page = s.get("/console/");
    assert_eq!(page.status, 200);
    assert!(
        page.header("content-type")
            .unwrap()
            .starts_with("text/html")
    );
    let csp = page.header("content-security-policy").unwrap().to_owned();
    assert!(
        csp.contains("script-src 'self' 'sha256-"),
        "the import map is allowed by its hash only: {csp}"
    );
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(page.text().contains("<script type=\"importmap\">"));
    // Revalidation: the same ETag gets a 304 and no body.
    let lib = s.get("/console/vendor/preact.mjs");
    assert_eq!(lib.status, 200);
    assert!(
        lib.header("content-type")
            .unwrap()
            .starts_with("text/javascript")
    );
    let etag = lib.header("etag").unwrap().to_owned();
    let again = s.get_with("/console/vendor/preact.mjs", &[("if-none-match", &etag)]);
    assert_eq!(again.status, 304);
    assert!(again.body.is_empty());
    assert_eq!(s.get("/console/no-such.js").status, 404);
    assert_eq!(s.get("/console/vendor/LICENSE.preact").status, 404);

    // Who a key is.
    let session = |key: Option<&str>| {
        let h = key.map(auth);
        let headers: Vec<(&str, &str)> = h.iter().map(|v| ("authorization", v.as_str())).collect();
        s.get_with("/console/session", &headers)
    };
    session(None).api_error(401, "invalid_request_error", "invalid_api_key");
    session(Some("wrong")).api_error(401, "invalid_request_error", "invalid_api_key");
    let admin = session(Some(ADMIN)).json();
    assert_eq!(
        admin["scopes"],
        json!(["infer", "jobs", "admin"]),
        "{admin}"
    );
    assert_eq!(admin["keys_configured"], true);
    let infer = session(Some(INFER)).json();
    assert_eq!(infer["key_id"], "inferer");
    assert_eq!(infer["scopes"], json!(["infer"]));
    // What the console hides from an infer-only key, the API refuses.
    let refused = call(s.addr, "GET", "/admin/policies", INFER, None);
    refused.api_error(403, "permission_error", "insufficient_scope");

    // A preview runs the transform on each record and writes nothing.
    let wasm = std::fs::read(wasm_path("alpaca_to_chat")).unwrap();
    let up = try_request(
        s.addr,
        "PUT",
        "/admin/policies/alpaca?kind=dataset-transform",
        &[("authorization", &auth(ADMIN))],
        Some(&wasm),
    )
    .unwrap();
    assert_eq!(up.status, 201, "{}", up.text());
    let preview = |body: Value| call(s.addr, "POST", "/api/datasets/preview", ADMIN, Some(&body));
    let r = preview(json!({"transform": "alpaca", "records": [
        {"instruction": "Say hi", "output": "Hi"},
        {"output": "no instruction"},
    ]}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(
        v["counts"],
        json!({"keep": 1, "drop": 0, "error": 1}),
        "{v}"
    );
    assert_eq!(
        v["results"][0]["output"]["messages"][1],
        json!({"role": "assistant", "content": "Hi"})
    );
    assert_eq!(v["results"][1]["reason"], "missing `instruction`");
    let v = preview(json!({"transform": "alpaca", "jsonl":
        "{\"instruction\": \"a\", \"output\": \"b\"}\n\nnot json\n"}))
    .json();
    assert_eq!(
        v["counts"],
        json!({"keep": 1, "drop": 0, "error": 1}),
        "{v}"
    );
    assert!(
        v["results"][1]["reason"]
            .as_str()
            .unwrap()
            .contains("invalid JSON")
    );
    // Bad requests name what is wrong.
    let bad = preview(json!({"transform": "alpaca"}));
    let e = bad.api_error(400, "invalid_request_error", "invalid_request");
    assert_eq!(e["param"], "records");
    let e = preview(json!({"records": [{}]})).api_error(
        400,
        "invalid_request_error",
        "invalid_request",
    );
    assert_eq!(e["param"], "steps");
    let many: Vec<Value> = (0..101).map(|i| json!({"instruction": i})).collect();
    let e = preview(json!({"transform": "alpaca", "records": many})).api_error(
        400,
        "invalid_request_error",
        "invalid_request",
    );
    assert!(
        e["message"].as_str().unwrap().contains("at most 100"),
        "{e}"
    );
    let e = preview(json!({"transform": "nope", "records": [{}]})).api_error(
        400,
        "invalid_request_error",
        "invalid_request",
    );
    assert_eq!(e["param"], "transform", "{e}");
    // The jobs zone: an infer-only key may not preview.
    let r = call(
        s.addr,
        "POST",
        "/api/datasets/preview",
        INFER,
        Some(&json!({})),
    );
    r.api_error(403, "permission_error", "insufficient_scope");

    // Turned off, the pages are gone and the API is as before.
    let off = server(root.path(), None, "[console]\nenabled = false");
    assert_eq!(off.get("/console/").status, 404);
    assert_eq!(off.get("/").status, 404);
    assert_eq!(off.get("/healthz").status, 200);
}

/// The tiny fine-tunable model and a data folder for it (as in
/// `tests/finetune.rs`), and a small alpaca JSONL for a dataset job.
fn fixtures(root: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let model = root.join("tiny");
    write_tiny_model(&model, &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let data = root.join("tiny-data");
    std::fs::create_dir_all(&data).unwrap();
    let lines: Vec<String> = (0..16)
        .map(|i| {
            json!({"messages": [
                {"role": "user", "content": format!("hi {i}")},
                {"role": "assistant", "content": "hello there"},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(data.join("train.jsonl"), lines[..12].join("\n")).unwrap();
    std::fs::write(data.join("valid.jsonl"), lines[12..].join("\n")).unwrap();
    let alpaca = root.join("alpaca.jsonl");
    let records: Vec<String> = (0..20)
        .map(|i| {
            json!({"instruction": format!("Count to {i}"), "input": "", "output": format!("{i}")})
                .to_string()
        })
        .chain([json!({"output": "no instruction"}).to_string()])
        .collect();
    std::fs::write(&alpaca, records.join("\n")).unwrap();
    (model, data, alpaca)
}

#[test]
fn console_works_in_a_real_browser() {
    let root_dir = workspace_root();
    let node_modules = root_dir.join(".deps/console/node_modules");
    assert!(
        node_modules.join("playwright-core").is_dir(),
        "{} has no playwright-core: run scripts/setup.sh --tests",
        node_modules.display()
    );
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).is_file(),
        "{chromium} is missing: run scripts/setup.sh --tests (it installs Debian's chromium)"
    );
    let root = tempfile::tempdir().unwrap();
    let (tiny, tiny_data, alpaca) = fixtures(root.path());
    let model = support::real_model();
    let s = server(root.path(), Some(&model), "");
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let model_id = ready.json()["model"].as_str().unwrap().to_owned();
    let bad = root.path().join("not-a-component.wasm");
    std::fs::write(&bad, b"\0asm this is not a component").unwrap();
    let shots = root_dir.join("target/console-screenshots");
    std::fs::create_dir_all(&shots).unwrap();

    let out = Command::new("node")
        .arg(root_dir.join("tests/console/e2e.cjs"))
        .env("NODE_PATH", &node_modules)
        .env("CHROMIUM", &chromium)
        .env("CONSOLE_URL", format!("http://{}/console/", s.addr))
        .env("ADMIN_KEY", ADMIN)
        .env("INFER_KEY", INFER)
        .env("SCREENSHOT_DIR", &shots)
        .env("MODEL_ID", &model_id)
        .env("ROUTER_WASM", wasm_path("tenant_router"))
        // Requests of tenants it does not know pass to the default route.
        .env("ROUTER_QUERY", "config=%7B%22unknown%22%3A%22pass%22%7D")
        .env("BAD_WASM", &bad)
        .env("TRANSFORM_WASM", wasm_path("alpaca_to_chat"))
        .env("DATASET_INPUT", &alpaca)
        .env("DATASET_OUTPUT_DIR", root.path().join("chat-data"))
        .env("FINETUNE_MODEL", &tiny)
        .env("FINETUNE_DATA", &tiny_data)
        .output()
        .expect("run node (scripts/setup.sh --tests installs it)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("all console checks passed"),
        "the browser test failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
    eprintln!("{stdout}");
    for page in [
        "signin",
        "chat",
        "jobs",
        "job-finetune",
        "policies",
        "resources",
        "metrics",
    ] {
        let png = std::fs::read(shots.join(format!("{page}.png")))
            .unwrap_or_else(|e| panic!("no screenshot of {page}: {e}"));
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 10_000,
            "{page}.png"
        );
    }
    // What the browser did went through the real API: the jobs it
    // submitted are there, done.
    let jobs = call(s.addr, "GET", "/api/jobs", ADMIN, None).json();
    let kinds: Vec<(&str, &str)> = jobs["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["status"] == "done")
        .map(|j| (j["kind"].as_str().unwrap(), j["status"].as_str().unwrap()))
        .collect();
    for kind in ["noop", "dataset", "finetune"] {
        assert!(
            kinds.iter().any(|(k, _)| *k == kind),
            "no {kind} job done: {jobs}"
        );
    }
    assert!(
        root.path().join("chat-data/train.jsonl").is_file(),
        "the dataset job wrote its output"
    );
}
