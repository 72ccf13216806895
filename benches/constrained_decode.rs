//! What constrained decoding costs: decode tokens/s of a request whose
//! output must match a JSON Schema against the same request unconstrained,
//! in the same run (one stream, then 8 streams at once), rounds alternating.
//! The schema (an array of at least 30 small objects) keeps the grammar busy
//! with structure, not one long string, and cannot end before the budget.
//! A third request measures what tools cost a request that answers in text:
//! with `tool_choice: auto` its text runs under the tool grammar (free text
//! that may turn into a call), so every token is masked.
//!
//! `cargo bench -p mlxgate --bench constrained_decode` (`MLXGATE_BENCH_MODEL`
//! for another GGUF, `CONSTRAINED_ROUNDS` rounds, default 3)

#[path = "common/mod.rs"]
mod common;

use std::time::Instant;

use mlxgate::engine::tools::{self, ToolFormat};
use mlxgate::engine::{EngineHandle, GenerateRequest, Grammar, Prompt, Tool, ToolChoice, ToolUse};
use serde_json::json;

const DECODE_TOKENS: usize = 64;

/// What constrains a request.
#[derive(Clone, Copy)]
enum Mode {
    Free,
    Json,
    ToolsAuto,
}

/// Greedy, end-of-sequence suppressed, so every run decodes `max_tokens`.
fn request(prompt: &str, mode: Mode) -> GenerateRequest {
    let mut r =
        GenerateRequest::greedy(Prompt::Text(prompt.into()), DECODE_TOKENS).suppressing(&[0, 2]);
    r.grammar = match mode {
        Mode::Free => None,
        Mode::ToolsAuto => {
            let tools = ToolUse {
                tools: vec![Tool {
                    name: "get_weather".into(),
                    description: Some("Weather in a city".into()),
                    parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                }],
                choice: ToolChoice::Auto,
                parallel: true,
            };
            tools::grammar(ToolFormat::Generic, &tools, None).expect("tool grammar")
        }
        Mode::Json => Some(Grammar::JsonSchema(json!({
            "type": "array",
            "minItems": 30,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "pet": {"enum": ["cat", "dog", "none"]}
                },
                "required": ["name", "age", "pet"],
                "additionalProperties": false
            }
        }))),
    };
    r
}

/// Decode tokens/s of one request, and its tokens.
fn run(engine: &EngineHandle, request: GenerateRequest) -> (f64, usize) {
    let t = common::timed(engine, request);
    (t.decode_rate(), t.usage.completion_tokens)
}

/// Aggregate decode tokens/s of 8 concurrent requests.
fn eight(engine: &EngineHandle, mode: Mode) -> f64 {
    let started = Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let prompt = format!("List people number {i} as JSON.");
                run(&engine, request(&prompt, mode)).1
            })
        })
        .collect();
    let tokens: usize = handles.into_iter().map(|h| h.join().expect("stream")).sum();
    tokens as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let model = common::bench_model();
    let engine = EngineHandle::load(&model)
        .unwrap_or_else(|e| panic!("load {} (run scripts/setup.sh): {e}", model.display()));
    let rounds: usize = std::env::var("CONSTRAINED_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let prompt = "List people with their age and pet as JSON.";
    // Warm up every path (the first constrained request builds the
    // vocabulary trie).
    for mode in [Mode::Free, Mode::Json, Mode::ToolsAuto] {
        run(&engine, request(prompt, mode));
    }
    let mut sums = [[0.0f64; 3]; 2];
    for round in 0..rounds {
        let mut line = format!("round {round}:");
        for (i, (mode, name)) in [
            (Mode::Free, "free"),
            (Mode::Json, "json"),
            (Mode::ToolsAuto, "tools-auto"),
        ]
        .into_iter()
        .enumerate()
        {
            let (one, tokens) = run(&engine, request(prompt, mode));
            let many = eight(&engine, mode);
            sums[0][i] += one;
            sums[1][i] += many;
            line += &format!(" {name} {one:.1} tok/s ({tokens} tokens), x8 {many:.1};");
        }
        println!("{line}");
    }
    let n = rounds as f64;
    for (streams, sum) in [(1, sums[0]), (8, sums[1])] {
        println!(
            "decode, {streams} stream(s): constrained {:.1} tok/s vs free {:.1} = {:.3}x; tools auto (text) {:.1} = {:.3}x",
            sum[1] / n,
            sum[0] / n,
            sum[1] / sum[0],
            sum[2] / n,
            sum[2] / sum[0]
        );
    }
}
