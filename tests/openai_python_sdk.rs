//! The official `openai` Python package talks to the server: runs
//! `tests/openai_sdk.py` against the real model. The package is installed
//! into `.deps/py` by `scripts/setup.sh`.

mod support;

use std::process::Command;
use std::time::Duration;

use support::{ServerBuilder, real_model, workspace_root};

#[test]
fn official_python_sdk_works_against_the_server() {
    let root = workspace_root();
    let deps = root.join(".deps/py");
    assert!(
        deps.join("openai").is_dir(),
        "{} has no openai package: run scripts/setup.sh",
        deps.display()
    );
    let s = ServerBuilder::new().model(real_model()).start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let out = Command::new("python3")
        .arg(root.join("tests/openai_sdk.py"))
        .arg(format!("http://{}/v1", s.addr))
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
        "openai_sdk.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
