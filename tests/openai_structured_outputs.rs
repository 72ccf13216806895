//! Structured outputs with the official `openai` Python package against the
//! real model: `tests/structured_outputs.py` sends 30 JSON Schemas as
//! `response_format` (8 at a time, mixed with free requests) and validates
//! every answer with `jsonschema`, then the SDK's `parse()` / `stream()`
//! helpers and the regex, Lark and `json_object` formats. One seed per
//! schema by default; `MLXGATE_STRUCTURED_SEEDS=3` runs each schema with
//! three seeds, whole and streamed (a few minutes).

mod support;

use std::time::Duration;

use support::{ServerBuilder, real_model, run_sdk_script};

#[test]
fn every_constrained_answer_validates_against_its_schema() {
    let seeds = std::env::var("MLXGATE_STRUCTURED_SEEDS").unwrap_or_else(|_| "1".into());
    let s = ServerBuilder::new().model(real_model()).start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    run_sdk_script(&s, "structured_outputs.py", "jsonschema", &[&seeds]);
}
