//! `quantize` jobs on tiny random-weight fixture models: the output folder
//! loads, its dequantized weights are within one quantization step of the
//! originals, config.json carries mlx-lm's quantization section with the
//! per-layer override, and bad configs are 400s naming the field.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use common::*;
use mlx_rs::{Array, Dtype};
use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);

fn f32s(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

#[test]
fn quantized_model_is_loadable_and_within_one_step() {
    let root = tempfile::tempdir().unwrap();
    let input = root.path().join("tiny");
    write_tiny_model(&input, &TinyModelSpec::new(Architecture::Qwen2)).unwrap();
    let out = root.path().join("tiny-4bit");
    let s = server(root.path(), "");
    let row = submit_ok(
        s.addr,
        "quantize",
        json!({
            "input": input.display().to_string(),
            "output_dir": out.display().to_string(),
            "bits": 4,
            "group_size": 32,
            "overrides": {"embed_tokens": {"bits": 8}},
        }),
    );
    let id = row["id"].as_str().unwrap().to_owned();
    let row = wait_final(s.addr, &id, T);
    assert_eq!(row["status"], "done", "{row}");
    let sum = &row["summary"];
    // Embeddings + 7 projections in each of 2 layers.
    assert_eq!(sum["quantized"], 15, "{sum}");
    assert!(
        sum["size_after"].as_u64().unwrap() < sum["size_before"].as_u64().unwrap() / 3,
        "{sum}"
    );
    let mean = sum["mean_rel_error"].as_f64().unwrap();
    assert!(mean > 0.0 && mean < 0.15, "{sum}");
    // The logit check ran both models on the text sample: quantization moved
    // the logits a little, not wildly.
    let logits = &sum["logit_error"];
    assert!(logits["sample_tokens"].as_u64().unwrap() > 10, "{sum}");
    let mean_abs = logits["mean_abs"].as_f64().unwrap();
    assert!(mean_abs > 0.0 && mean_abs < 0.5, "{sum}");

    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["quantization"],
        json!({"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}})
    );
    assert_eq!(config["quantization_config"], config["quantization"]);
    assert_eq!(config["model_type"], "qwen2");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(input.join(f)).unwrap()
        );
    }

    let before = Array::load_safetensors(input.join("model.safetensors")).unwrap();
    let after = Array::load_safetensors(out.join("model.safetensors")).unwrap();
    for (name, w) in &before {
        let Some(module) = name.strip_suffix(".weight").filter(|_| w.ndim() == 2) else {
            // Norms and biases are kept as they were.
            assert_eq!(f32s(&after[name]), f32s(w), "{name}");
            continue;
        };
        let bits = if module == "model.embed_tokens" { 8 } else { 4 };
        let (q, scales, biases) = (
            &after[name],
            &after[&format!("{module}.scales")],
            &after[&format!("{module}.biases")],
        );
        assert_eq!(q.dtype(), Dtype::Uint32, "{name}");
        assert_eq!(
            q.shape()[1] * 32 / bits,
            w.shape()[1],
            "{name} packs {bits} bits"
        );
        let deq = f32s(&mlx_rs::ops::dequantize(q, scales, biases, 32, bits).unwrap());
        let (orig, steps) = (f32s(w), f32s(scales));
        assert_eq!(deq.len(), orig.len());
        for (i, (a, b)) in orig.iter().zip(&deq).enumerate() {
            let step = steps[i / 32].abs();
            assert!(
                (a - b).abs() <= step + 1e-6,
                "{name}[{i}]: {a} vs {b} (step {step})"
            );
        }
    }

    // The engine loads the quantized folder.
    mlxgate::engine::LoadedModel::load(&out)
        .unwrap_or_else(|e| panic!("load {}: {e}", out.display()));

    // Progress per tensor in the stream.
    let ev = parse_sse(
        &call(
            s.addr,
            "GET",
            &format!("/api/jobs/{id}/events"),
            ADMIN,
            None,
        )
        .text(),
    );
    let per_tensor = ev.iter().filter(|e| e.1["stage"] == "quantize").count();
    assert_eq!(per_tensor, 15);
    assert!(
        ev.iter()
            .any(|e| e.1["stage"] == "quantize" && e.1["rel_error"].is_number())
    );

    // The output now exists: a second run is refused up front.
    let r = submit(
        s.addr,
        ADMIN,
        "quantize",
        json!({"input": input.display().to_string(), "output_dir": out.display().to_string()}),
    );
    assert_eq!(
        r.api_error(400, "invalid_request_error", "invalid_request")["param"],
        "config.output_dir"
    );
}

#[test]
fn eight_bit_and_bad_configs() {
    let root = tempfile::tempdir().unwrap();
    let input = root.path().join("tiny");
    write_tiny_model(&input, &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let s = server(root.path(), "");
    let out = root.path().join("tiny-8bit");
    let p = |v: &std::path::Path| v.display().to_string();
    let row = submit_ok(
        s.addr,
        "quantize",
        json!({"input": p(&input), "output_dir": p(&out), "bits": 8, "overrides": {"mlp.down_proj": false}}),
    );
    let row = wait_final(s.addr, row["id"].as_str().unwrap(), T);
    assert_eq!(row["status"], "done", "{row}");
    assert_eq!(row["summary"]["quantized"], 13);
    assert!(
        row["summary"]["max_rel_error"].as_f64().unwrap() < 0.02,
        "{row}"
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization"]["bits"], 8);
    assert_eq!(config["quantization"]["group_size"], 64);
    assert_eq!(
        config["quantization"]["model.layers.0.mlp.down_proj"],
        false
    );
    let after = Array::load_safetensors(out.join("model.safetensors")).unwrap();
    assert!(!after.contains_key("model.layers.1.mlp.down_proj.scales"));
    assert_eq!(
        after["model.layers.1.mlp.down_proj.weight"].dtype(),
        Dtype::Float32
    );

    let param = |config: Value| {
        let r = submit(s.addr, ADMIN, "quantize", config);
        r.api_error(400, "invalid_request_error", "invalid_request")["param"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let fresh = p(&root.path().join("fresh"));
    assert_eq!(
        param(json!({"input": p(&input), "output_dir": fresh, "bits": 3})),
        "config.bits"
    );
    assert_eq!(
        param(json!({"input": p(&input), "output_dir": fresh, "group_size": 48})),
        "config.group_size"
    );
    assert_eq!(
        param(
            json!({"input": p(&input), "output_dir": fresh, "overrides": {"lm_head": {"bits": 5}}})
        ),
        "config.overrides.lm_head"
    );
    assert_eq!(
        param(json!({"input": p(&input), "output_dir": "/tmp/elsewhere"})),
        "config.output_dir"
    );
    assert_eq!(
        param(json!({"input": "/usr", "output_dir": fresh})),
        "config.input"
    );
    assert_eq!(param(json!({"output_dir": fresh})), "config.input");
}
