//! LoRA adapters against Python mlx-lm on SmolLM2, both ways: an adapter
//! trained by mlx-lm (`mlx_lm lora`) applied by mlxgate, and an adapter
//! trained by mlxgate (`engine::train`) loaded by mlx-lm
//! (`mlx_lm.load(..., adapter_path=...)`). Either way mlxgate's greedy
//! tokens with the adapter equal mlx-lm's for every reference prompt, and
//! the first-step logits are within 1e-3. The greedy tokens are checked on
//! both decode paths: MLX's graph and, where this CPU runs them, the native
//! kernels (adapters added by `lora::add_native`).
//!
//! Needs the figures of `scripts/check-lora-against-mlx-lm.sh`, which runs
//! these ignored-by-default tests with `MLXGATE_LORA_REFERENCE_JSON` (the
//! mlx-lm-trained adapter) and `MLXGATE_LORA_MLXGATE_REFERENCE_JSON` (the
//! mlxgate-trained one) set.

use std::path::PathBuf;
use std::rc::Rc;

use mlxgate::engine::LoadedModel;
use mlxgate::engine::lora::{self, AdapterStack};
use mlxgate::engine::model::{KvCache, Transformer};
use mlxgate::mlx::kernels::{self, KernelChoice};
use serde_json::Value;

/// The greedy choice, as the engine makes it.
fn argmax(values: &[f32]) -> u32 {
    mlxgate::engine::argmax(values) as u32
}

fn numbers<T>(v: &Value, f: impl Fn(&Value) -> T) -> Vec<T> {
    v.as_array().expect("an array").iter().map(f).collect()
}

#[test]
#[ignore = "needs Python mlx-lm figures: run scripts/check-lora-against-mlx-lm.sh"]
fn mlx_lm_trained_adapter_gives_mlx_lm_greedy_tokens() {
    same_greedy_tokens_as_mlx_lm("MLXGATE_LORA_REFERENCE_JSON");
}

#[test]
#[ignore = "needs Python mlx-lm figures: run scripts/check-lora-against-mlx-lm.sh"]
fn mlxgate_trained_adapter_gives_the_same_greedy_tokens_in_mlx_lm() {
    let reference = same_greedy_tokens_as_mlx_lm("MLXGATE_LORA_MLXGATE_REFERENCE_JSON");
    assert_eq!(
        reference["adapter_config"]["trained_with"], "mlxgate",
        "this reference must be of an adapter mlxgate trained"
    );
}

/// `n` greedy tokens after `prompt` (prefilled through MLX), each decode
/// step on `choice`'s path, as the engine's scheduler steps a sequence.
fn greedy(
    model: &Transformer,
    prompt: &[u32],
    adapters: &AdapterStack,
    n: usize,
    choice: KernelChoice,
) -> Vec<u32> {
    kernels::set_thread_choice(KernelChoice::Native);
    let mut cache: KvCache = model.new_cache();
    let first = model
        .forward_with_adapters(&[prompt], &mut [&mut cache], &[adapters])
        .unwrap();
    first.eval().unwrap();
    let mut token = argmax(first.as_slice::<f32>());
    let mut tokens = vec![token];
    while tokens.len() < n {
        kernels::set_thread_choice(choice);
        let logits = model
            .decode(&[token], &mut [&mut cache], &[adapters])
            .unwrap();
        token = argmax(&logits);
        tokens.push(token);
    }
    tokens
}

/// Compares mlxgate with the adapter (and without) to the mlx-lm figures
/// named by `env`; returns them.
fn same_greedy_tokens_as_mlx_lm(env: &str) -> Value {
    let path = std::env::var_os(env).unwrap_or_else(|| {
        panic!("{env} must name the figures of scripts/reference_lora_mlx_lm.py")
    });
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    println!(
        "reference {}: adapter {} trained by {}",
        path.to_string_lossy(),
        reference["adapter_dir"],
        reference["trained_by"]
    );
    let model_dir = PathBuf::from(reference["model_dir"].as_str().unwrap());
    let adapter_dir = PathBuf::from(reference["adapter_dir"].as_str().unwrap());
    let loaded = LoadedModel::load(&model_dir).unwrap();
    let model = loaded.transformer;
    let adapter = lora::load("reference", &adapter_dir, &loaded.id, &model.lora_targets()).unwrap();
    println!(
        "adapter: {} rank {} scale {} on {} modules",
        adapter.info.format, adapter.info.rank, adapter.info.scale, adapter.info.modules
    );
    let stack: AdapterStack = vec![Rc::new(adapter)];
    let none = AdapterStack::new();
    if kernels::native_available() {
        let read = model.native_decode_weight_bytes();
        println!("native decode reads {read:?} bytes of weights per token");
        assert!(
            read.is_some() && lora::is_native(&stack),
            "this CPU runs the native kernels, but this model or adapter does not decode on them"
        );
    }

    let mut changed = 0;
    for (index, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = numbers(&case["prompt_tokens"], |v| v.as_u64().unwrap() as u32);
        for (key, adapters) in [("with_adapter", &stack), ("base", &none)] {
            let expected = numbers(&case[key]["tokens"], |v| v.as_u64().unwrap() as u32);
            let mut cache = model.new_cache();
            let first = model
                .forward_with_adapters(&[&prompt], &mut [&mut cache], &[adapters])
                .unwrap();
            first.eval().unwrap();
            let step = first.as_slice::<f32>();
            if let Some(logits) = case[key].get("logits_first").filter(|v| v.is_array()) {
                let logits = numbers(logits, |v| v.as_f64().unwrap() as f32);
                let diff = step
                    .iter()
                    .zip(&logits)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                println!("case {index} {key}: first-step logits max |diff| = {diff:.3e}");
                assert!(diff <= 1e-3, "case {index} {key}: logits differ by {diff}");
            }
            let mut paths = vec![KernelChoice::Mlx];
            if kernels::native_available() {
                paths.push(KernelChoice::Native);
            }
            for choice in paths {
                let tokens = greedy(&model, &prompt, adapters, expected.len(), choice);
                let same = tokens
                    .iter()
                    .zip(&expected)
                    .take_while(|(a, b)| a == b)
                    .count();
                println!(
                    "case {index} {key} ({choice:?} decode): greedy tokens identical: {same} of {}",
                    expected.len()
                );
                assert_eq!(
                    tokens, expected,
                    "case {index} {key} ({choice:?} decode): diverges after {same} tokens"
                );
            }
        }
        let base = &case["base"]["tokens"];
        changed += usize::from(case["with_adapter"]["tokens"] != *base);
    }
    assert!(
        changed > 0,
        "the adapter changed no answer: the reference proves nothing"
    );
    reference
}
