//! LoRA adapters through the real engine, on a 4-bit quantized tiny model:
//! output with an adapter equals output of a dense model with the adapter
//! merged into the dequantized weights; stacking equals merging both; both
//! adapter formats load; bad adapters are refused whole; mixed batches are
//! right; unmounting leaves running requests alone.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::Array;
use mlx_rs::ops::{add, dequantize, matmul, multiply, quantize};
use mlxgate::engine::{EngineError, EngineHandle, GenerateEvent, GenerateRequest, Prompt};
use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};
use serde_json::json;

const PROJECTIONS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// Deterministic values in [-amp, amp).
fn noise(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

fn load(dir: &Path) -> HashMap<String, Array> {
    let arrays = Array::load_safetensors(dir.join("model.safetensors")).unwrap();
    mlx_rs::transforms::eval(arrays.values()).unwrap();
    arrays
}

fn save(dir: &Path, from: &Path, tensors: &HashMap<String, Array>, quantized: bool) {
    std::fs::create_dir_all(dir).unwrap();
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(from.join(name), dir.join(name)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    if quantized {
        config["quantization"] = json!({"group_size": 32, "bits": 4});
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let metadata = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
    Array::save_safetensors(tensors, &metadata, dir.join("model.safetensors")).unwrap();
}

/// One adapter's factors per projection, mlx-lm orientation: a [in, r], b [r, out].
struct Factors {
    pairs: Vec<(String, Array, Array)>,
    scale: f32,
}

fn factors(
    base: &HashMap<String, Array>,
    layers: usize,
    only: &[&str],
    rank: i32,
    seed: u64,
    scale: f32,
) -> Factors {
    let mut pairs = Vec::new();
    for layer in 0..layers {
        for (i, projection) in PROJECTIONS
            .iter()
            .enumerate()
            .filter(|(_, p)| only.contains(p))
        {
            let module = format!("model.layers.{layer}.{projection}");
            let shape = base[&format!("{module}.weight")].shape().to_vec();
            let (out, input) = (shape[0], shape[1]);
            let s = seed + (layer * 10 + i) as u64;
            let a = Array::from_slice(&noise((input * rank) as usize, s, 0.3), &[input, rank]);
            let b = Array::from_slice(&noise((rank * out) as usize, s + 1000, 0.3), &[rank, out]);
            pairs.push((module, a, b));
        }
    }
    Factors { pairs, scale }
}

fn write_mlx_lm_adapter(dir: &Path, f: &Factors, rank: i32, base_model: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let tensors: HashMap<String, Array> = f
        .pairs
        .iter()
        .flat_map(|(m, a, b)| {
            [
                (format!("{m}.lora_a"), a.clone()),
                (format!("{m}.lora_b"), b.clone()),
            ]
        })
        .collect();
    Array::save_safetensors(&tensors, None, dir.join("adapters.safetensors")).unwrap();
    let config = json!({"fine_tune_type": "lora", "model": base_model, "num_layers": 2,
        "lora_parameters": {"rank": rank, "scale": f.scale, "dropout": 0.0}});
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
}

fn write_peft_adapter(dir: &Path, f: &Factors, rank: i32) {
    std::fs::create_dir_all(dir).unwrap();
    let tensors: HashMap<String, Array> = f
        .pairs
        .iter()
        .flat_map(|(m, a, b)| {
            [
                (format!("base_model.model.{m}.lora_A.weight"), a.t()),
                (format!("base_model.model.{m}.lora_B.weight"), b.t()),
            ]
        })
        .collect();
    Array::save_safetensors(&tensors, None, dir.join("adapter_model.safetensors")).unwrap();
    let config = json!({"peft_type": "LORA", "r": rank, "lora_alpha": f.scale * rank as f32,
        "target_modules": ["q_proj", "v_proj"]});
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
}

/// `w + scale * (a b)^T` for every pair of every adapter.
fn merge(weights: &mut HashMap<String, Array>, adapters: &[&Factors]) {
    for f in adapters {
        for (module, a, b) in &f.pairs {
            let name = format!("{module}.weight");
            let delta = multiply(matmul(a, b).unwrap().t(), Array::from_f32(f.scale)).unwrap();
            let merged = add(&weights[&name], &delta).unwrap();
            weights.insert(name, merged);
        }
    }
}

fn greedy(prompt: &str, adapters: &[&str]) -> GenerateRequest {
    GenerateRequest {
        logprobs: Some(0),
        adapters: adapters.iter().map(|s| s.to_string()).collect(),
        ..GenerateRequest::greedy(Prompt::Text(prompt.into()), 12)
    }
}

/// Token ids and their logprobs.
fn collect(
    stream: &mut mlxgate::engine::GenerationStream,
) -> Result<(Vec<u32>, Vec<f32>), EngineError> {
    let (mut ids, mut logprobs) = (Vec::new(), Vec::new());
    while let Some(event) = stream.blocking_next() {
        match event? {
            GenerateEvent::Delta { tokens, .. } => {
                for t in tokens {
                    ids.push(t.id);
                    logprobs.push(t.logprob.unwrap());
                }
            }
            GenerateEvent::Finished { .. } => return Ok((ids, logprobs)),
        }
    }
    panic!("stream ended without Finished");
}

fn run(
    engine: &EngineHandle,
    request: GenerateRequest,
) -> Result<(Vec<u32>, Vec<f32>), EngineError> {
    collect(&mut engine.generate(request)?)
}

#[track_caller]
fn assert_close(got: &(Vec<u32>, Vec<f32>), want: &(Vec<u32>, Vec<f32>)) {
    assert_eq!(got.0, want.0, "greedy tokens differ");
    for (g, w) in got.1.iter().zip(&want.1) {
        assert!((g - w).abs() < 2e-3, "logprob {g} vs {w}");
    }
}

const PROMPT: &str = "the quick brown fox";

#[test]
fn adapters_on_a_quantized_base_equal_merged_weights() {
    let root = tempfile::tempdir().unwrap();
    let (fixture, quantized_dir) = (root.path().join("fixture"), root.path().join("tiny-4bit"));
    let spec = TinyModelSpec::new(Architecture::Llama);
    write_tiny_model(&fixture, &spec).unwrap();

    // Quantize the seven projections; keep their dequantized values for merging.
    let base = load(&fixture);
    let mut quantized = base.clone();
    let mut dequantized = base.clone();
    for name in base
        .keys()
        .filter(|n| PROJECTIONS.iter().any(|p| n.contains(p)))
    {
        let (w, scales, biases) = quantize(&base[name], 32, 4).unwrap();
        let prefix = name.trim_end_matches(".weight");
        dequantized.insert(
            name.clone(),
            dequantize(&w, &scales, &biases, 32, 4).unwrap(),
        );
        quantized.insert(name.clone(), w);
        quantized.insert(format!("{prefix}.scales"), scales);
        quantized.insert(format!("{prefix}.biases"), biases);
    }
    save(&quantized_dir, &fixture, &quantized, true);

    let stores = root.path().join("adapters");
    let x = factors(&base, spec.layers, &PROJECTIONS, 4, 1, 2.0);
    let y = factors(
        &base,
        spec.layers,
        &["self_attn.q_proj", "self_attn.v_proj"],
        4,
        50,
        1.5,
    );
    write_mlx_lm_adapter(&stores.join("x"), &x, 4, "some/org/tiny-4bit");
    write_peft_adapter(&stores.join("y"), &y, 4);

    let engine = EngineHandle::load(&quantized_dir).unwrap();
    let base_out = run(&engine, greedy(PROMPT, &[])).unwrap();
    let info = engine.mount_adapter("x", &stores.join("x")).unwrap();
    assert_eq!(
        (info.format, info.rank, info.modules),
        ("mlx-lm", 4, 7 * spec.layers)
    );
    let info = engine.mount_adapter("y", &stores.join("y")).unwrap();
    assert_eq!(
        (info.format, info.scale, info.modules),
        ("peft", 1.5, 2 * spec.layers)
    );

    let merged_dir = |name: &str, adapters: &[&Factors]| {
        let mut weights = dequantized.clone();
        merge(&mut weights, adapters);
        let dir = root.path().join(name);
        save(&dir, &fixture, &weights, false);
        EngineHandle::load(&dir).unwrap()
    };
    let with_x = run(&engine, greedy(PROMPT, &["x"])).unwrap();
    assert_ne!(with_x.0, base_out.0, "the adapter should change the output");
    assert_close(
        &with_x,
        &run(&merged_dir("merged-x", &[&x]), greedy(PROMPT, &[])).unwrap(),
    );
    let stacked = run(&engine, greedy(PROMPT, &["x", "y"])).unwrap();
    assert_close(
        &stacked,
        &run(&merged_dir("merged-xy", &[&x, &y]), greedy(PROMPT, &[])).unwrap(),
    );
    let base_again = run(&engine, greedy(PROMPT, &[])).unwrap();
    assert_close(
        &base_again,
        &run(&merged_dir("dequantized", &[]), greedy(PROMPT, &[])).unwrap(),
    );

    // A batch mixing base, x and x+y gives each request its own answer.
    let requests = [vec![], vec!["x"], vec!["x", "y"], vec!["x"]];
    let mut streams: Vec<_> = requests
        .iter()
        .map(|ids| engine.generate(greedy(PROMPT, ids)).unwrap())
        .collect();
    let outs: Vec<_> = streams.iter_mut().map(|s| collect(s).unwrap()).collect();
    assert_close(&outs[0], &base_out);
    assert_close(&outs[1], &with_x);
    assert_close(&outs[2], &stacked);
    assert_close(&outs[3], &with_x);

    // Unknown ids are refused, naming what is mounted.
    match run(&engine, greedy(PROMPT, &["x", "zzz"])) {
        Err(EngineError::UnknownAdapter { requested, mounted }) => {
            assert_eq!(requested, "zzz");
            assert_eq!(mounted, vec!["x", "y"]);
        }
        other => panic!("unknown adapter accepted: {other:?}"),
    }

    // Unmounting while a request uses it: the request finishes unchanged.
    let mut running = engine.generate(greedy(PROMPT, &["x"])).unwrap();
    assert!(engine.unmount_adapter("x").unwrap());
    assert_close(&collect(&mut running).unwrap(), &with_x);
    assert!(!engine.unmount_adapter("x").unwrap());
    assert!(matches!(
        run(&engine, greedy(PROMPT, &["x"])),
        Err(EngineError::UnknownAdapter { .. })
    ));
}

#[test]
fn bad_adapters_are_refused_whole() {
    let root = tempfile::tempdir().unwrap();
    let fixture = root.path().join("fixture");
    let spec = TinyModelSpec::new(Architecture::Llama);
    write_tiny_model(&fixture, &spec).unwrap();
    let base = load(&fixture);
    let engine = EngineHandle::load(&fixture).unwrap();
    let refusal = |name: &str, f: &dyn Fn(&Path)| {
        let dir = root.path().join(name);
        f(&dir);
        match engine.mount_adapter(name, &dir) {
            Err(EngineError::Adapter(message)) => message,
            other => panic!("{name} mounted: {other:?}"),
        }
    };

    // Wrong input width on one module (the rest are fine): nothing mounts.
    let message = refusal("wide", &|dir| {
        let mut f = factors(&base, spec.layers, &PROJECTIONS, 4, 1, 2.0);
        let (_, a, _) = &mut f.pairs[5];
        *a = Array::from_slice(&noise(999 * 4, 3, 0.1), &[999, 4]);
        write_mlx_lm_adapter(dir, &f, 4, "");
    });
    assert!(
        message.contains("model.layers.0.mlp.up_proj") && message.contains("999"),
        "{message}"
    );
    // Half a pair.
    let message = refusal("half", &|dir| {
        write_mlx_lm_adapter(
            dir,
            &factors(&base, 1, &["self_attn.q_proj"], 4, 1, 2.0),
            4,
            "",
        );
        let mut tensors = Array::load_safetensors(dir.join("adapters.safetensors")).unwrap();
        // MLX reads lazily: materialize before overwriting the file.
        mlx_rs::transforms::eval(tensors.values()).unwrap();
        tensors.remove("model.layers.0.self_attn.q_proj.lora_b");
        Array::save_safetensors(&tensors, None, dir.join("adapters.safetensors")).unwrap();
    });
    assert!(message.contains("only one of lora_a / lora_b"), "{message}");
    // Nothing that matches the model's projections.
    let message = refusal("nothing", &|dir| {
        std::fs::create_dir_all(dir).unwrap();
        let t = HashMap::from([(
            "lm_head.lora_a".to_owned(),
            Array::from_slice(&[0f32; 4], &[2, 2]),
        )]);
        Array::save_safetensors(&t, None, dir.join("adapters.safetensors")).unwrap();
        std::fs::write(
            dir.join("adapter_config.json"),
            r#"{"lora_parameters": {"rank": 2, "scale": 1}}"#,
        )
        .unwrap();
    });
    assert!(message.contains("matches none"), "{message}");
    // Trained on another base model.
    let message = refusal("other", &|dir| {
        write_mlx_lm_adapter(
            dir,
            &factors(&base, 1, &["self_attn.q_proj"], 4, 1, 2.0),
            4,
            "google/gemma-3-270m",
        );
    });
    assert!(message.contains("gemma-3-270m"), "{message}");
    // A DoRA adapter is not LoRA.
    let message = refusal("dora", &|dir| {
        write_mlx_lm_adapter(
            dir,
            &factors(&base, 1, &["self_attn.q_proj"], 4, 1, 2.0),
            4,
            "",
        );
        let config =
            json!({"fine_tune_type": "dora", "lora_parameters": {"rank": 4, "scale": 2.0}});
        std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    });
    assert!(message.contains("dora"), "{message}");
    assert!(
        engine.adapters().is_empty(),
        "a refused adapter left something mounted"
    );
    // And the engine still serves.
    run(&engine, greedy(PROMPT, &[])).unwrap();
}
