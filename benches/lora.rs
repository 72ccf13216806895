//! LoRA on the packaged SmolLM2 (Q4_1, no HTTP), or the GGUF named by
//! `MLXGATE_BENCH_MODEL`, each adapter rank 8 on all seven projections of
//! every layer:
//!
//! 1. mount time;
//! 2. single-stream decode tokens/s with one adapter and with a stack of two
//!    vs the base model, interleaved rounds, medians;
//! 3. prefill of a 512-token prompt (time to the first token) with one
//!    adapter vs the base model;
//! 4. eight concurrent streams, four with an adapter and four plain, in one
//!    batch vs eight plain streams: aggregate tokens/s;
//! 5. eight streams, four per adapter: one mixed batch vs the two groups in
//!    turn.
//!
//! ```text
//! cargo bench -p mlxgate --bench lora
//! MLXGATE_BENCH_MODEL=models/qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \
//!     cargo bench -p mlxgate --bench lora
//! ```
//!
//! The model's end-of-text tokens are suppressed so that every run decodes
//! the same number of tokens.

#[path = "common/mod.rs"]
mod common;

use std::time::Instant;

use mlxgate::engine::{
    EngineHandle, GenerateEvent, GenerateRequest, GenerationStream, LoadedModel, Prompt,
    SamplingParams,
};
use mlxgate::fixtures::{LoraSpec, write_random_lora};

const TOKENS: usize = 32;
const ROUNDS: usize = 3;
/// The model under test and the token ids that would end a stream early.
struct Bench {
    engine: EngineHandle,
    suppressed: Vec<u32>,
}

fn request(b: &Bench, adapters: &[&str]) -> GenerateRequest {
    request_for(
        b,
        Prompt::Text("Tell me a story about a lighthouse keeper.".into()),
        adapters,
    )
}

fn request_for(b: &Bench, prompt: Prompt, adapters: &[&str]) -> GenerateRequest {
    GenerateRequest {
        prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            logit_bias: b.suppressed.iter().map(|&t| (t, -100.0)).collect(),
            ..SamplingParams::default()
        },
        max_tokens: Some(TOKENS),
        stop: vec![],
        logprobs: None,
        prompt_cache: None,
        adapters: adapters.iter().map(|s| s.to_string()).collect(),
        cache_scope: mlxgate::engine::prompt_cache::CacheScope::operator(),
        priority: 0,
        grammar: None,
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
fn decode_rate(b: &Bench, adapters: &[&str]) -> f64 {
    let (secs, tokens) = drain(b.engine.generate(request(b, adapters)).unwrap());
    (tokens - 1) as f64 / secs
}

/// Seconds from submitting a 512-token prompt to its first token. `round`
/// starts the prompt with its own token, so no run reuses another's cache.
fn prefill_secs(b: &Bench, round: usize, adapters: &[&str]) -> f64 {
    let text = "The lighthouse keeper wrote in his log every night. ".repeat(60);
    let mut ids = b.engine.tokenize(&format!("{round} {text}")).unwrap();
    ids.truncate(512);
    let mut request = request_for(b, Prompt::Tokens(ids), adapters);
    request.max_tokens = Some(1);
    let started = Instant::now();
    let mut stream = b.engine.generate(request).unwrap();
    while let Some(event) = stream.blocking_next() {
        if let GenerateEvent::Finished { .. } = event.expect("event") {
            return started.elapsed().as_secs_f64();
        }
    }
    panic!("stream ended early");
}

/// Wall seconds for all `groups` of streams, each group submitted at once.
fn wall(b: &Bench, groups: &[Vec<&[&str]>]) -> f64 {
    let started = Instant::now();
    for group in groups {
        let streams: Vec<_> = group
            .iter()
            .map(|a| b.engine.generate(request(b, a)).unwrap())
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
    let model = common::bench_model();
    // The adapters' shapes and the end-of-text ids come from the model.
    let loaded = LoadedModel::load(&model).expect("load the model (run scripts/setup.sh)");
    let spec = LoraSpec::for_config(&loaded.transformer.config, 20.0, 0.01);
    let suppressed = loaded.codec.eos_ids.clone();
    drop(loaded);
    let bench = Bench {
        engine: EngineHandle::load(&model).expect("load the model"),
        suppressed,
    };
    let engine = &bench.engine;
    println!(
        "{}: {} layers, adapters rank {} on 7 projections",
        model.display(),
        spec.layers,
        spec.rank
    );
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for (dir, seed) in [(&a, 1), (&b, 2)] {
        write_random_lora(
            dir,
            &LoraSpec {
                seed,
                ..spec.clone()
            },
        )
        .unwrap();
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
        "mount, {} pairs: median {:.1} ms (runs: {:?})",
        7 * spec.layers,
        median(mounts.clone()),
        mounts.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>()
    );

    decode_rate(&bench, &[]);
    let (mut base, mut one, mut two) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        base.push(decode_rate(&bench, &[]));
        one.push(decode_rate(&bench, &["a"]));
        two.push(decode_rate(&bench, &["a", "b"]));
    }
    let (base, one, two) = (median(base), median(one), median(two));
    println!(
        "single stream decode: base {base:.2} tok/s, one adapter {one:.2} tok/s ({:.2}x base), a stack of two {two:.2} tok/s ({:.2}x base)",
        one / base,
        two / base
    );

    let (mut base, mut adapted) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        base.push(prefill_secs(&bench, 2 * round, &[]));
        adapted.push(prefill_secs(&bench, 2 * round + 1, &["a"]));
    }
    let (base, adapted) = (median(base), median(adapted));
    println!(
        "prefill of 512 tokens: base {:.0} tok/s, one adapter {:.0} tok/s: {:.2}x base",
        512.0 / base,
        512.0 / adapted,
        base / adapted
    );

    let plain: &[&str] = &[];
    let with_a: &[&str] = &["a"];
    let half = vec![vec![
        with_a, plain, with_a, plain, with_a, plain, with_a, plain,
    ]];
    let all_plain = vec![vec![plain; 8]];
    let (mut h, mut p) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        h.push(wall(&bench, &half));
        p.push(wall(&bench, &all_plain));
    }
    let (h, p) = (median(h), median(p));
    let total = (8 * TOKENS) as f64;
    println!(
        "8 streams of {TOKENS} tokens in one batch: 4 adapted + 4 plain {:.1} tok/s, 8 plain {:.1} tok/s: {:.2}x",
        total / h,
        total / p,
        p / h
    );

    let with_b: &[&str] = &["b"];
    let mixed = vec![vec![
        with_a, with_b, with_a, with_b, with_a, with_b, with_a, with_b,
    ]];
    let separated = vec![vec![with_a; 4], vec![with_b; 4]];
    let (mut m, mut s) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        m.push(wall(&bench, &mixed));
        s.push(wall(&bench, &separated));
    }
    let (m, s) = (median(m), median(s));
    println!(
        "8 streams, 4 per adapter, {TOKENS} tokens each: one mixed batch {m:.2} s, two groups in turn {s:.2} s: mixed is {:.2}x the speed",
        s / m
    );
}
