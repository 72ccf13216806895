//! What constrained decoding costs: decode tokens/s of a request whose
//! output must match a JSON Schema against the same request unconstrained,
//! in the same run (one stream, then 8 streams at once), rounds alternating.
//! The schema (an array of at least 30 small objects) keeps the grammar busy
//! with structure, not one long string, and cannot end before the budget.
//!
//! `cargo bench -p mlxgate --bench constrained_decode` (`MLXGATE_BENCH_MODEL`
//! for another GGUF, `CONSTRAINED_ROUNDS` rounds, default 3)

#[path = "common/mod.rs"]
mod common;

use std::time::Instant;

use mlxgate::engine::{EngineHandle, GenerateRequest, Grammar, Prompt};
use serde_json::json;

const DECODE_TOKENS: usize = 64;

/// Greedy, end-of-sequence suppressed, so every run decodes `max_tokens`.
fn request(prompt: &str, constrained: bool) -> GenerateRequest {
    let mut r =
        GenerateRequest::greedy(Prompt::Text(prompt.into()), DECODE_TOKENS).suppressing(&[0, 2]);
    if constrained {
        r.grammar = Some(Grammar::JsonSchema(json!({
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
        })));
    }
    r
}

/// Decode tokens/s of one request, and its tokens.
fn run(engine: &EngineHandle, request: GenerateRequest) -> (f64, usize) {
    let t = common::timed(engine, request);
    (t.decode_rate(), t.usage.completion_tokens)
}

/// Aggregate decode tokens/s of 8 concurrent requests.
fn eight(engine: &EngineHandle, constrained: bool) -> f64 {
    let started = Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let prompt = format!("List people number {i} as JSON.");
                run(&engine, request(&prompt, constrained)).1
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
    // Warm up both paths (the first constrained request builds the
    // vocabulary trie).
    run(&engine, request(prompt, false));
    run(&engine, request(prompt, true));
    let (mut free1, mut json1, mut free8, mut json8) = (0.0, 0.0, 0.0, 0.0);
    for round in 0..rounds {
        let (f, ft) = run(&engine, request(prompt, false));
        let (c, ct) = run(&engine, request(prompt, true));
        let (f8, c8) = (eight(&engine, false), eight(&engine, true));
        println!(
            "round {round}: 1 stream free {f:.1} tok/s ({ft} tokens), constrained {c:.1} tok/s ({ct} tokens); 8 streams free {f8:.1}, constrained {c8:.1}"
        );
        (free1, json1, free8, json8) = (free1 + f, json1 + c, free8 + f8, json8 + c8);
    }
    let n = rounds as f64;
    println!(
        "decode, 1 stream: constrained {:.1} tok/s vs free {:.1} = {:.3}x",
        json1 / n,
        free1 / n,
        json1 / free1
    );
    println!(
        "decode, 8 streams: constrained {:.1} tok/s vs free {:.1} = {:.3}x",
        json8 / n,
        free8 / n,
        json8 / free8
    );
}
