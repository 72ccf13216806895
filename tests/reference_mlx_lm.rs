//! mlxgate's engine against Python mlx-lm on the same converted model: the
//! first-step logits agree within 1e-4 and 64 greedy tokens are identical.
//!
//! Needs reference figures from `scripts/check-against-mlx-lm.sh`, which runs
//! this ignored-by-default test with `MLXGATE_REFERENCE_JSON` set. The same
//! test checks the engine on a GPU against Hugging Face transformers
//! (`scripts/gpu/reference_transformers.py`), where
//! `MLXGATE_REFERENCE_TOLERANCE` (default 1e-4) bounds the logits' difference
//! and `MLXGATE_REFERENCE_MIN_SAME` (default: all) how many greedy tokens
//! must agree before the first difference.

use std::path::PathBuf;

use mlxgate::engine::LoadedModel;
use serde_json::Value;

/// The greedy choice, as the engine makes it.
fn argmax(values: &[f32]) -> u32 {
    mlxgate::engine::argmax(values) as u32
}

#[test]
#[ignore = "needs Python mlx-lm figures: run scripts/check-against-mlx-lm.sh"]
fn engine_matches_mlx_lm_logits_and_greedy_tokens() {
    let path = std::env::var_os("MLXGATE_REFERENCE_JSON").expect(
        "MLXGATE_REFERENCE_JSON must name the figures written by scripts/reference_mlx_lm.py",
    );
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        reference[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, expected_tokens) = (ids("prompt_tokens"), ids("greedy_tokens"));
    let expected_logits: Vec<f32> = reference["first_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();

    // The script records the directory relative to the repository root;
    // cargo runs tests from gateway/.
    let model_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(reference["model_dir"].as_str().unwrap());
    let model = LoadedModel::load(&model_dir).unwrap().transformer;
    let mut cache = model.new_cache();
    let first = model.forward(&[&prompt], &mut [&mut cache]).unwrap();
    first.eval().unwrap();
    let logits = first.as_slice::<f32>().to_vec();
    assert_eq!(logits.len(), expected_logits.len());
    let diff = logits
        .iter()
        .zip(&expected_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    println!(
        "first-step logits: max |mlxgate - mlx-lm| = {diff:.3e} over {} values",
        logits.len()
    );

    let mut tokens = Vec::new();
    let mut step = logits;
    for _ in 0..expected_tokens.len() {
        let token = argmax(&step);
        tokens.push(token);
        let next = model.forward(&[&[token]], &mut [&mut cache]).unwrap();
        next.eval().unwrap();
        step = next.as_slice::<f32>().to_vec();
    }
    let same = tokens
        .iter()
        .zip(&expected_tokens)
        .take_while(|(a, b)| a == b)
        .count();
    println!(
        "greedy tokens identical: {same} of {}",
        expected_tokens.len()
    );
    let largest = expected_logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    println!(
        "largest |logit| {largest:.3e}; relative difference {:.3e}",
        diff / largest
    );
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<f64>().ok());
    let tolerance = env("MLXGATE_REFERENCE_TOLERANCE").unwrap_or(1e-4) as f32;
    let min_same = env("MLXGATE_REFERENCE_MIN_SAME").map_or(expected_tokens.len(), |v| v as usize);
    if let Some(margins) = reference.get("margins").and_then(Value::as_array)
        && same < expected_tokens.len()
    {
        println!(
            "the reference's margin at the first difference (step {same}): {}",
            margins[same]
        );
    }
    assert!(
        diff <= tolerance,
        "first-step logits differ by {diff} (tolerance {tolerance})"
    );
    assert!(
        same >= min_same,
        "greedy tokens diverge after {same} (at least {min_same} must agree): {tokens:?} vs {expected_tokens:?}"
    );
}
