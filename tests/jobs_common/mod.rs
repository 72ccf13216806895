//! Shared helpers for the jobs tests: keys with different scopes, a gateway
//! with a `[jobs]` section, polling a job, and reading server-sent events
//! as they arrive.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{Response, Server, ServerBuilder};

/// All scopes (the bootstrap admin key).
pub const ADMIN: &str = "jobs-test-admin-key";
/// Only the `jobs` scope.
pub const WORKER: &str = "jobs-test-worker-key";
/// Only the `infer` scope.
pub const INFER: &str = "jobs-test-infer-key";

fn key_entry(id: &str, key: &str, scope: &str) -> String {
    format!(
        "[[keys]]\nid = \"{id}\"\ntenant = \"t\"\nscopes = [\"{scope}\"]\nsha256 = \"{}\"\n",
        mlxgate::http::auth::KeyHash::of(key).to_hex()
    )
}

/// Config text: the two extra keys, and `[jobs]` with `jobs_section` lines.
pub fn config_toml(jobs_section: &str) -> String {
    format!(
        "{}{}[jobs]\n{jobs_section}\n",
        key_entry("worker", WORKER, "jobs"),
        key_entry("inferer", INFER, "infer")
    )
}

/// A gateway whose jobs may use files under `root`.
pub fn server(root: &Path, extra_jobs: &str) -> Server {
    let section = format!(
        "allowed_paths = [{:?}]\n{extra_jobs}",
        root.display().to_string()
    );
    ServerBuilder::new()
        .config(&config_toml(&section))
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start()
}

/// Uploads `wasm` as policy `name` with the admin key (`query`: `kind=...`
/// and any limits) and returns the policy's info; asserts it was taken.
pub fn put_policy(addr: SocketAddr, name: &str, query: &str, wasm: &[u8]) -> Value {
    let r = crate::support::try_request(
        addr,
        "PUT",
        &format!("/admin/policies/{name}?{query}"),
        &[("authorization", &auth(ADMIN))],
        Some(wasm),
    )
    .unwrap();
    assert!(matches!(r.status, 200 | 201), "{name}: {}", r.text());
    r.json()
}

pub fn auth(key: &str) -> String {
    format!("Bearer {key}")
}

pub fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    body: Option<&Value>,
) -> Response {
    crate::support::keyed_call(addr, method, path, key, body)
}

pub fn submit(addr: SocketAddr, key: &str, kind: &str, config: Value) -> Response {
    call(
        addr,
        "POST",
        "/api/jobs",
        key,
        Some(&json!({"kind": kind, "config": config})),
    )
}

/// Submits and expects 201; returns the row.
pub fn submit_ok(addr: SocketAddr, kind: &str, config: Value) -> Value {
    let r = submit(addr, ADMIN, kind, config);
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()
}

pub fn get_job(addr: SocketAddr, id: &str) -> Value {
    let r = call(addr, "GET", &format!("/api/jobs/{id}"), ADMIN, None);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Polls the row until `done(row)` holds.
pub fn wait_job(
    addr: SocketAddr,
    id: &str,
    timeout: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        let row = get_job(addr, id);
        if done(&row) {
            return row;
        }
        assert!(
            Instant::now() < deadline,
            "job {id} did not get there in time: {row}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

pub fn wait_final(addr: SocketAddr, id: &str, timeout: Duration) -> Value {
    wait_job(addr, id, timeout, |r| {
        !matches!(r["status"].as_str(), Some("queued" | "running"))
    })
}

/// `(id, data)` of each complete event in SSE text.
pub fn parse_sse(text: &str) -> Vec<(u64, Value)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut id = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = v.parse().ok();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(v).ok();
                }
            }
            Some((id?, data?))
        })
        .collect()
}

/// A live SSE response read incrementally (chunked transfer decoded).
pub struct SseStream {
    reader: BufReader<TcpStream>,
    buf: String,
    ended: bool,
}

impl SseStream {
    pub fn open(addr: SocketAddr, path: &str, key: &str, extra: &[(&str, &str)]) -> SseStream {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut req = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAuthorization: Bearer {key}\r\n"
        );
        for (k, v) in extra {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).unwrap();
        let mut reader = BufReader::new(s);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert!(line.contains(" 200 "), "status line {line:?}");
        let mut chunked = false;
        let mut content_type = String::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            let l = line.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            chunked |= l == "transfer-encoding: chunked";
            if let Some(v) = l.strip_prefix("content-type: ") {
                content_type = v.to_owned();
            }
        }
        assert!(chunked, "SSE responses are chunked");
        assert_eq!(content_type, "text/event-stream");
        SseStream {
            reader,
            buf: String::new(),
            ended: false,
        }
    }

    /// The next event, or `None` once the stream has ended.
    pub fn next_event(&mut self) -> Option<(u64, Value)> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                if let Some(e) = parse_sse(&block).pop() {
                    return Some(e);
                }
                continue;
            }
            if self.ended {
                return None;
            }
            let mut line = String::new();
            self.reader.read_line(&mut line).unwrap();
            let size = usize::from_str_radix(line.trim(), 16).expect("chunk size");
            let mut chunk = vec![0; size + 2];
            self.reader.read_exact(&mut chunk).unwrap();
            if size == 0 {
                self.ended = true;
            }
            self.buf.push_str(&String::from_utf8_lossy(&chunk[..size]));
        }
    }

    pub fn collect_rest(&mut self) -> Vec<(u64, Value)> {
        std::iter::from_fn(|| self.next_event()).collect()
    }
}

/// Reads a job's NDJSON log: every line parses except possibly a torn last one.
pub fn read_log(path: &Path) -> (Vec<Value>, bool) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.split('\n').collect();
    let mut events = Vec::new();
    let mut torn = false;
    for (i, line) in lines.iter().enumerate() {
        if line.is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(v) => events.push(v),
            Err(e) => {
                assert!(
                    i == lines.len() - 1,
                    "line {i} of {} does not parse ({e}): {line}",
                    path.display()
                );
                torn = true;
            }
        }
    }
    (events, torn)
}
