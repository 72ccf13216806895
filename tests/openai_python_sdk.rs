//! The official `openai` Python package talks to the server: runs
//! `tests/openai_sdk.py` against the real model. The package is installed
//! into `.deps/py` by `scripts/setup.sh`.

mod support;

use std::time::Duration;

use support::{ServerBuilder, real_model, run_sdk_script};

#[test]
fn official_python_sdk_works_against_the_server() {
    let s = ServerBuilder::new().model(real_model()).start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    run_sdk_script(&s, "openai_sdk.py", "openai", &[]);
}
