//! `finetune` jobs: LoRA SFT through the jobs API.
//!
//! On SmolLM2-135M (4-bit GGUF), served by the same gateway, with a fixture
//! dataset whose answers all start with "Ahoy!": a short run makes the
//! validation loss fall, writes an mlx-lm adapter into the adapter store
//! under its name (listed by `/v1/adapters/available`), mounts it on the
//! served model (`mount: true`), and chat requests selecting it answer in
//! that style. On a tiny fixture model: the event stream follows the seed
//! contract, bad configs are 400s naming the field, a cancelled job keeps a
//! checkpoint that a resubmitted job resumes, an unnamed adapter lands in
//! the store under the job's id, and a mount that cannot happen fails the
//! job saying where the adapter is.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use mlxgate::engine::EngineHandle;
use mlxgate::fixtures::{Architecture, TinyModelSpec, write_tiny_model};
use serde_json::{Value, json};
use support::ServerBuilder;

const QUESTIONS: &[&str] = &[
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What colour is the sky?",
    "Name a fruit that is yellow.",
    "What is two plus two?",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "How many days are in a week?",
    "What is frozen water called?",
    "What animal barks?",
    "Which ocean is the largest?",
    "What is the opposite of hot?",
    "What gas do plants breathe in?",
    "How many hours are in a day?",
    "What is the tallest animal?",
    "What language is spoken in Spain?",
    "What do cows drink?",
    "Which season comes after winter?",
    "What shape has three sides?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest mammal?",
    "What metal is liquid at room temperature?",
    "How many continents are there?",
];

const ANSWERS: &[&str] = &[
    "Paris, matey.",
    "Eight legs, matey.",
    "Blue, matey.",
    "A banana, matey.",
    "Four, matey.",
    "Mercury, matey.",
    "Honey, matey.",
    "Seven, matey.",
    "Ice, matey.",
    "A dog, matey.",
    "The Pacific, matey.",
    "Cold, matey.",
    "Carbon dioxide, matey.",
    "Twenty-four, matey.",
    "The giraffe, matey.",
    "Spanish, matey.",
    "Water, matey.",
    "Spring, matey.",
    "A triangle, matey.",
    "One hundred degrees, matey.",
    "Shakespeare, matey.",
    "The blue whale, matey.",
    "Mercury, matey.",
    "Seven, matey.",
];

fn write_dataset(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let line = |i: usize| {
        json!({"messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": QUESTIONS[i]},
            {"role": "assistant", "content": format!("Ahoy! {}", ANSWERS[i])},
        ]})
        .to_string()
    };
    let train: Vec<String> = (0..18).map(line).collect();
    let valid: Vec<String> = (18..24).map(line).collect();
    std::fs::write(dir.join("train.jsonl"), train.join("\n")).unwrap();
    std::fs::write(dir.join("valid.jsonl"), valid.join("\n")).unwrap();
}

/// A gateway whose jobs may read `roots` and whose adapter store is
/// `store`.
fn gateway(roots: &[&Path], store: &Path) -> support::Server {
    gateway_with(roots, store, None)
}

/// [`gateway`], serving `model` when given (and ready when returned).
fn gateway_with(roots: &[&Path], store: &Path, model: Option<&Path>) -> support::Server {
    let roots: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    let section = format!(
        "allowed_paths = {roots:?}\n[adapters]\nstores = [{:?}]\n",
        store.display().to_string()
    );
    let mut b = ServerBuilder::new()
        .config(&config_toml(&section))
        .env("MLXGATE_ADMIN_KEY", ADMIN);
    if let Some(m) = model {
        b = b.model(m);
    }
    // The quantized-matmul kernels the served model runs may be chosen by
    // the test's environment (`MLXGATE_KERNELS=mlx|native`).
    if let Ok(kernels) = std::env::var("MLXGATE_KERNELS") {
        b = b.env("MLXGATE_KERNELS", kernels);
    }
    let s = b.start();
    if model.is_some() {
        s.wait_for_status("/readyz", 200, Duration::from_secs(300));
    }
    s
}

/// The job's stored events (its NDJSON log).
fn events(row: &Value) -> Vec<Value> {
    std::fs::read_to_string(row["log_path"].as_str().unwrap())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn metrics<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["type"] == "metric" && e["kind"] == kind)
        .collect()
}

/// The greedy answer (3 tokens) to a chat question over HTTP, with its
/// tokens' logprobs; `adapter` goes in the body.
fn answer(
    addr: SocketAddr,
    model: &str,
    question: &str,
    adapter: Option<&str>,
) -> (String, Vec<f64>) {
    let mut body = json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": question},
        ],
        "temperature": 0,
        "max_tokens": 3,
        "logprobs": true,
    });
    if let Some(a) = adapter {
        body["adapter"] = json!(a);
    }
    let r = call(addr, "POST", "/v1/chat/completions", ADMIN, Some(&body));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choice = &v["choices"][0];
    let logprobs = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap())
        .collect();
    (
        choice["message"]["content"].as_str().unwrap().to_owned(),
        logprobs,
    )
}

#[test]
fn smollm2_learns_a_reply_style_into_the_store_and_mounts_itself() {
    let started = Instant::now();
    let model = support::real_model();
    assert!(
        model.is_file(),
        "{} is missing: run scripts/setup.sh",
        model.display()
    );
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("pirate");
    write_dataset(&data);
    let store = root.path().join("adapters");
    let models = model.parent().unwrap().to_owned();
    // The gateway serves the model it trains on.
    let s = gateway_with(&[root.path(), &models], &store, Some(&model));
    let row = submit_ok(
        s.addr,
        "finetune",
        json!({
            "model": model.display().to_string(),
            "data": data.display().to_string(),
            "name": "pirate",
            "mount": true,
            "rank": 8,
            "scale": 20.0,
            "num_layers": 4,
            "learning_rate": 1e-3,
            "warmup_steps": 2,
            "batch_size": 4,
            "max_seq_len": 128,
            "iterations": 14,
            "val_interval": 7,
            "report_interval": 1,
            "checkpoint_interval": 7,
            "seed": 3,
        }),
    );
    let id = row["id"].as_str().unwrap().to_owned();
    let row = wait_final(s.addr, &id, Duration::from_secs(600));
    let train_time = started.elapsed();
    assert_eq!(row["status"], "done", "{row}");
    let evs = events(&row);
    let val: Vec<(u64, f64)> = metrics(&evs, "val")
        .iter()
        .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
        .collect();
    let train: Vec<(u64, f64)> = metrics(&evs, "train")
        .iter()
        .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
        .collect();
    eprintln!("validation loss by step: {val:?}");
    eprintln!("training loss by step: {train:?}");
    eprintln!("summary: {}", row["summary"]);
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), [0, 7, 14]);
    let (first, last) = (val[0].1, val[2].1);
    assert!(last < 0.5 * first, "validation loss should fall: {val:?}");
    assert!(val[1].1 < first, "{val:?}");
    // Written into the (first) adapter store under its name, in mlx-lm's
    // format, recording its base.
    let out = store.join("pirate");
    assert_eq!(
        row["output_path"],
        out.canonicalize().unwrap().display().to_string()
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["fine_tune_type"], "lora");
    assert_eq!(config["num_layers"], 4);
    assert_eq!(config["lora_parameters"]["rank"], 8);
    assert_eq!(config["base_model"], "SmolLM2-135M-Instruct");
    assert!(
        !out.join("checkpoint").exists(),
        "the checkpoint is removed on success"
    );
    // The job said it mounted the adapter, on the served model.
    let mounts: Vec<&Value> = evs
        .iter()
        .filter(|e| e["type"] == "stage" && e["stage"] == "mount")
        .collect();
    assert_eq!(mounts.len(), 2, "{mounts:?}");
    let served = mounts[1]["model"].as_str().unwrap().to_owned();
    assert_eq!(mounts[1]["adapter"], "pirate");
    assert!(
        mounts[1]["message"]
            .as_str()
            .unwrap()
            .contains("mounted as `pirate`"),
        "{}",
        mounts[1]
    );
    assert_eq!(row["summary"]["adapter"], "pirate");
    assert_eq!(row["summary"]["mounted_on"], served.as_str());

    let listed = call(s.addr, "GET", "/v1/adapters/available", ADMIN, None).json();
    let entry = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "pirate")
        .unwrap_or_else(|| panic!("not listed: {listed}"));
    assert_eq!(entry["format"], "mlx-lm");
    assert_eq!(entry["rank"], 8);
    assert_eq!(entry["mounted"], true, "{entry}");
    let mounted = call(s.addr, "GET", "/v1/adapters", INFER, None).json();
    let entry = mounted["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "pirate")
        .unwrap_or_else(|| panic!("not mounted: {mounted}"));
    assert_eq!(entry["model"], served.as_str());
    assert_eq!(entry["modules"], 4 * 7);

    // Chat requests selecting it answer in the trained style; the base does not.
    let (mut styled, mut base_styled) = (0, 0);
    let mut firsts = Vec::new();
    for q in &QUESTIONS[18..21] {
        let (base, base_lp) = answer(s.addr, &served, q, None);
        let (tuned, tuned_lp) = answer(s.addr, &served, q, Some("pirate"));
        eprintln!("{q} base {base:?} {base_lp:?} | tuned {tuned:?} {tuned_lp:?}");
        base_styled += usize::from(base.trim_start().starts_with("Ah"));
        styled += usize::from(tuned.trim_start().starts_with("Ah"));
        firsts.push(tuned_lp[0]);
    }
    assert_eq!(base_styled, 0, "the base model does not answer with Ahoy");
    assert_eq!(styled, 3, "every tuned answer starts with Ahoy");
    // Greedy and confident: the first answer token is likely under the adapter.
    assert!(firsts.iter().all(|lp| *lp > -0.7), "{firsts:?}");

    // The same name again is refused at submit: the store holds it, and
    // it is mounted.
    let r = submit(
        s.addr,
        ADMIN,
        "finetune",
        json!({
            "model": model.display().to_string(),
            "data": data.display().to_string(),
            "name": "pirate",
        }),
    );
    let e = r.api_error(400, "invalid_request_error", "invalid_request");
    assert_eq!(e["param"], "config.name", "{e}");
    eprintln!("train {:?}, whole test {:?}", train_time, started.elapsed());
}

fn tiny_setup(root: &Path) -> (PathBuf, PathBuf) {
    let model = root.join("tiny");
    write_tiny_model(&model, &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let lines: Vec<String> = (0..16)
        .map(|i| match i % 3 {
            0 => json!({"text": format!("the hen {i} ate the oat")}).to_string(),
            1 => json!({"prompt": format!("tell {i}"), "completion": " all well"}).to_string(),
            _ => json!({"messages": [
                {"role": "user", "content": format!("hi {i}")},
                {"role": "assistant", "content": "hello there"},
            ]})
            .to_string(),
        })
        .collect();
    std::fs::write(data.join("train.jsonl"), lines[..12].join("\n")).unwrap();
    std::fs::write(data.join("valid.jsonl"), lines[12..].join("\n")).unwrap();
    (model, data)
}

#[test]
fn events_follow_the_contract_and_cancel_keeps_a_checkpoint_to_resume() {
    let root = tempfile::tempdir().unwrap();
    let (model, data) = tiny_setup(root.path());
    let store = root.path().join("adapters");
    std::fs::create_dir_all(&store).unwrap();
    let s = gateway(&[root.path()], &store);
    let out = store.join("tiny-lora");
    let config = json!({
        "model": model.display().to_string(),
        "data": data.display().to_string(),
        "output_dir": out.display().to_string(),
        "rank": 4,
        "alpha": 16,
        "dropout": 0.1,
        "keys": ["q_proj", "v_proj", "down_proj"],
        "num_layers": 2,
        "learning_rate": 1e-3,
        "warmup_steps": 5,
        "batch_size": 2,
        "grad_accumulation": 2,
        "iterations": 400,
        "val_interval": 100,
        "report_interval": 5,
        "checkpoint_interval": 1000,
        "max_grad_norm": 1.0,
    });

    // Bad configs are 400s naming the field.
    for (field, value, param) in [
        ("rank", json!(0), "config.rank"),
        ("keys", json!(["lm_head"]), "config.keys"),
        ("output_dir", json!("/tmp/elsewhere"), "config.output_dir"),
        ("mount_model", json!("x"), "config.mount_model"),
        ("name", json!("no/such"), "config.name"),
        ("bogus", json!(1), "config.bogus"),
        ("scale", json!(2.0), "config.alpha"),
    ] {
        let mut c = config.clone();
        c[field] = value;
        let r = submit(s.addr, ADMIN, "finetune", c);
        let e = r.api_error(400, "invalid_request_error", "invalid_request");
        assert_eq!(e["param"], param, "{e}");
    }

    // Only adapters inside a store are mounted.
    let mut c = config.clone();
    c["mount"] = json!(true);
    c["output_dir"] = json!(root.path().join("elsewhere").display().to_string());
    let e = submit(s.addr, ADMIN, "finetune", c).api_error(
        400,
        "invalid_request_error",
        "invalid_request",
    );
    assert_eq!(e["param"], "config.mount", "{e}");

    // Cancel while training: the job stops and keeps a checkpoint.
    let row = submit_ok(s.addr, "finetune", config.clone());
    let id = row["id"].as_str().unwrap().to_owned();
    let t = Instant::now();
    wait_job(s.addr, &id, Duration::from_secs(120), |r| {
        r["progress"].as_f64().unwrap_or(0.0) >= 0.05
            || r["status"] != "running" && r["status"] != "queued"
    });
    let r = call(s.addr, "DELETE", &format!("/api/jobs/{id}"), ADMIN, None);
    assert_eq!(r.status, 200, "{}", r.text());
    let cancelled = wait_final(s.addr, &id, Duration::from_secs(60));
    eprintln!("cancelled after {:?}", t.elapsed());
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint/trainer_state.json")).unwrap(),
    )
    .unwrap();
    let saved = state["step"].as_u64().unwrap();
    assert!((20..400).contains(&saved), "{state}");
    assert!(!out.join("adapters.safetensors").exists());
    let evs = events(&cancelled);
    let last_train = metrics(&evs, "train").last().unwrap()["step"]
        .as_u64()
        .unwrap();
    assert!(
        saved >= last_train && saved < last_train + 5,
        "{saved} vs {last_train}"
    );
    assert_eq!(evs.last().unwrap()["type"], "cancelled");

    // Submitted again, it resumes from the checkpoint and finishes.
    let row = submit_ok(s.addr, "finetune", config.clone());
    let id = row["id"].as_str().unwrap().to_owned();
    let row = wait_final(s.addr, &id, Duration::from_secs(300));
    assert_eq!(row["status"], "done", "{row}");
    assert_eq!(row["summary"]["resumed_from"], saved, "{row}");
    assert_eq!(row["summary"]["steps"], 400);
    let evs = events(&row);
    // The seed grammar: started, stages load/train/save, metrics, done.
    let types: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types[0], "started");
    assert_eq!(*types.last().unwrap(), "done");
    let stages: Vec<&str> = evs
        .iter()
        .filter(|e| e["type"] == "stage")
        .map(|e| e["stage"].as_str().unwrap())
        .collect();
    assert_eq!(stages.first(), Some(&"load"));
    assert!(
        stages.contains(&"train") && stages.last() == Some(&"save"),
        "{stages:?}"
    );
    assert!(
        evs.iter().any(|e| e["type"] == "log"
            && e["line"]
                .as_str()
                .unwrap()
                .contains(&format!("step {saved}"))),
        "a log line says where it resumed"
    );
    let train = metrics(&evs, "train");
    assert!(train[0]["step"].as_u64().unwrap() > saved);
    for m in &train {
        for k in [
            "step",
            "loss",
            "grad_norm",
            "learning_rate",
            "tokens_per_sec",
            "progress",
        ] {
            assert!(m[k].is_number(), "train metric lacks {k}: {m}");
        }
    }
    let val = metrics(&evs, "val");
    assert!(
        val.iter()
            .all(|m| m["loss"].is_number() && m["step"].is_number())
    );
    assert_eq!(val.last().unwrap()["step"], 400);
    let done = evs.last().unwrap();
    assert_eq!(
        done["output_dir"],
        out.canonicalize().unwrap().display().to_string()
    );
    let summary = &done["summary"];
    for k in [
        "final_train_loss",
        "final_val_loss",
        "train_seconds",
        "trained_tokens",
        "tokens_per_sec",
    ] {
        assert!(summary[k].is_number(), "summary lacks {k}: {summary}");
    }
    // The learning rate followed warmup then cosine decay to ~0.
    let last_lr = train.last().unwrap()["learning_rate"].as_f64().unwrap();
    assert!(last_lr < 1e-5, "{last_lr}");
    // The adapter loads through the serving path.
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["lora_parameters"]["scale"], 4.0);
    assert_eq!(
        config["lora_parameters"]["keys"],
        json!(["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"])
    );
    let engine = EngineHandle::load(&model).unwrap();
    let info = engine.mount_adapter("tiny", &out).unwrap();
    assert_eq!((info.modules, info.rank), (2 * 3, 4));
    // Resubmitting into a finished adapter folder is refused.
    let r = submit(
        s.addr,
        ADMIN,
        "finetune",
        config_for_rerun(&out, &model, &data),
    );
    let e = r.api_error(400, "invalid_request_error", "invalid_request");
    assert_eq!(e["param"], "config.output_dir");
}

fn config_for_rerun(out: &Path, model: &Path, data: &Path) -> Value {
    json!({
        "model": model.display().to_string(),
        "data": data.display().to_string(),
        "output_dir": out.display().to_string(),
    })
}

#[test]
fn unnamed_adapters_go_to_the_store_under_the_job_id_and_a_failed_mount_fails_the_job() {
    let root = tempfile::tempdir().unwrap();
    let (model, data) = tiny_setup(root.path());
    // Not created here: the gateway creates its stores.
    let store = root.path().join("adapters");
    let s = gateway(&[root.path()], &store);
    let config = json!({
        "model": model.display().to_string(),
        "data": data.display().to_string(),
        "rank": 4,
        "num_layers": 2,
        "batch_size": 2,
        "learning_rate": 1e-3,
        "iterations": 6,
        "report_interval": 2,
    });
    let row = submit_ok(s.addr, "finetune", config.clone());
    let id = row["id"].as_str().unwrap().to_owned();
    let row = wait_final(s.addr, &id, Duration::from_secs(120));
    assert_eq!(row["status"], "done", "{row}");
    let out = store.canonicalize().unwrap().join(&id);
    assert!(out.join("adapters.safetensors").is_file());
    assert_eq!(row["output_path"], out.display().to_string());
    assert_eq!(row["summary"]["adapter"], id.as_str());
    assert_eq!(row["summary"]["mounted_on"], Value::Null);
    let listed = call(s.addr, "GET", "/v1/adapters/available", ADMIN, None).json();
    let entry = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == id.as_str())
        .unwrap_or_else(|| panic!("not listed: {listed}"));
    assert_eq!(entry["mounted"], false);
    assert_eq!(entry["format"], "mlx-lm");

    // `mount: true` on a gateway without a ready model: the job fails and
    // says why and where the adapter it wrote is.
    let mut c = config.clone();
    c["mount"] = json!(true);
    c["name"] = json!("tiny-mounted");
    let row = submit_ok(s.addr, "finetune", c);
    let id = row["id"].as_str().unwrap().to_owned();
    let row = wait_final(s.addr, &id, Duration::from_secs(120));
    assert_eq!(row["status"], "failed", "{row}");
    let error = row["error"].as_str().unwrap();
    let written = store.canonicalize().unwrap().join("tiny-mounted");
    for part in [
        written.display().to_string().as_str(),
        "no served model is ready",
        "POST /v1/adapters",
    ] {
        assert!(error.contains(part), "{part:?} not in {error:?}");
    }
    assert!(written.join("adapters.safetensors").is_file());
    let evs = events(&row);
    assert!(
        evs.iter().any(|e| e["type"] == "stage"
            && e["stage"] == "mount"
            && e["adapter"] == "tiny-mounted"),
        "a stage event says it mounts"
    );
    assert_eq!(evs.last().unwrap()["type"], "failed");
}
