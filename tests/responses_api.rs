//! OpenAI's Responses API over real HTTP with the official `openai` Python
//! package against the real model (`tests/responses_api.py`): text and
//! streamed events, a function-tool round trip through
//! `previous_response_id`, `text.format`, bad input; and a stored response
//! continued after the gateway restarts (redb in the data dir), read back
//! and deleted.

mod support;

use std::time::Duration;

use support::{ServerBuilder, real_model, run_sdk_script};

const MODEL: &str = "SmolLM2-135M-Instruct";

#[test]
fn the_openai_sdk_creates_streams_and_chains_responses() {
    let s = ServerBuilder::new().model(real_model()).start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    run_sdk_script(&s, "responses_api.py", "openai", &[MODEL, "all"]);
}

#[test]
fn a_stored_response_continues_after_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let id = {
        let s = ServerBuilder::new()
            .model(real_model())
            .data_dir(data.path())
            .start();
        s.wait_for_status("/readyz", 200, Duration::from_secs(120));
        let out = run_sdk_script(&s, "responses_api.py", "openai", &[MODEL, "store"]);
        out.lines()
            .find_map(|l| l.strip_prefix("stored: "))
            .expect("the stored id")
            .to_owned()
    };
    let s = ServerBuilder::new()
        .model(real_model())
        .data_dir(data.path())
        .start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    run_sdk_script(&s, "responses_api.py", "openai", &[MODEL, "continue", &id]);
}
