//! Engine speed on the packaged SmolLM2 or another GGUF (no HTTP): prefill tokens/s,
//! decode tokens/s of one stream, and aggregate decode tokens/s of 8 concurrent
//! streams (continuous batching) with its ratio to one stream.
//!
//! `cargo bench -p mlxgate --bench engine_decode` (`MLXGATE_BENCH_MODEL=path.gguf`
//! for another model)

#[path = "common/mod.rs"]
mod common;

use std::time::Instant;

use mlxgate::engine::{EngineHandle, GenerateRequest, Prompt};

const DECODE_TOKENS: usize = 48;

/// Greedy, with end-of-sequence suppressed so every run decodes `max_tokens`.
fn request(prompt: &str, max_tokens: usize) -> GenerateRequest {
    // SmolLM2 ends with <|endoftext|> (0) or <|im_end|> (2).
    GenerateRequest::greedy(Prompt::Text(prompt.into()), max_tokens).suppressing(&[0, 2])
}

/// Runs one request: (seconds to first token, seconds in all, tokens).
fn run(engine: &EngineHandle, request: GenerateRequest) -> (f64, f64, usize) {
    let t = common::timed(engine, request);
    (t.first, t.total, t.usage.completion_tokens)
}

fn main() {
    // MLXGATE_BENCH_MODEL: another GGUF (e.g. Qwen2.5-Coder, whose Q5_0
    // matrices take their own kernel).
    let model = common::bench_model();
    let engine = EngineHandle::load(&model)
        .unwrap_or_else(|e| panic!("load {} (run scripts/setup.sh): {e}", model.display()));
    let long_prompt = "The history of the lighthouse is long. ".repeat(40);
    let prompt_tokens = engine.tokenize(&long_prompt).unwrap().len();
    run(&engine, request("Warm up.", 4));

    let (ttft, _, _) = run(&engine, request(&long_prompt, 1));
    println!(
        "prefill: {prompt_tokens} tokens in {ttft:.3} s = {:.1} tok/s",
        prompt_tokens as f64 / ttft
    );

    let (first, total, tokens) = run(
        &engine,
        request("Tell me a story about a fox.", DECODE_TOKENS),
    );
    let single = (tokens - 1) as f64 / (total - first);
    println!("decode, 1 stream: {single:.1} tok/s ({tokens} tokens)");

    let started = Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                run(
                    &engine,
                    request(
                        &format!("Tell me story number {i} about a fox."),
                        DECODE_TOKENS,
                    ),
                )
            })
        })
        .collect();
    let generated: usize = handles
        .into_iter()
        .map(|h| h.join().expect("stream").2)
        .sum();
    let aggregate = generated as f64 / started.elapsed().as_secs_f64();
    println!(
        "decode, 8 streams: {aggregate:.1} tok/s aggregate = {:.2}x one stream",
        aggregate / single
    );
}
