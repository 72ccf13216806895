//! Structured outputs with the official `openai` Python package against the
//! real model: `tests/structured_outputs.py` sends 30 JSON Schemas as
//! `response_format` (8 at a time, mixed with free requests) and validates
//! every answer with `jsonschema`, then the SDK's `parse()` / `stream()`
//! helpers and the regex, Lark and `json_object` formats. One seed per
//! schema by default; `MLXGATE_STRUCTURED_SEEDS=3` runs each schema with
//! three seeds, whole and streamed (a few minutes).

mod support;

use std::process::Command;
use std::time::Duration;

use support::{ServerBuilder, real_model, workspace_root};

#[test]
fn every_constrained_answer_validates_against_its_schema() {
    let root = workspace_root();
    let deps = root.join(".deps/py");
    assert!(
        deps.join("jsonschema").is_dir(),
        "{} has no jsonschema package: run scripts/setup.sh",
        deps.display()
    );
    let seeds = std::env::var("MLXGATE_STRUCTURED_SEEDS").unwrap_or_else(|_| "1".into());
    let s = ServerBuilder::new().model(real_model()).start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let out = Command::new("python3")
        .arg(root.join("tests/structured_outputs.py"))
        .arg(format!("http://{}/v1", s.addr))
        .arg(&seeds)
        .env("PYTHONPATH", &deps)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "structured_outputs.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
