//! Connection hardening against the real binary: slow and partial bodies get
//! 408 and are closed, floods over the connection caps are refused at once
//! without stopping `/healthz`, a stream whose client stops reading is
//! cancelled so its batch slot frees, and per-key concurrency caps.
//!
//! Loopback accepts every 127.0.0.0/8 address, so floods come from
//! 127.0.0.2+ while the health probe comes from 127.0.0.1.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::BIN;

/// Generous bound for anything the server should do "promptly".
const PROMPT: Duration = Duration::from_secs(20);
/// How long a request queued behind 16 stalled streams may wait: their
/// filling the buffers (a few dozen tokens each; over a minute for a
/// 16-batch on a busy 2-core debug build) plus the 2 s stall bound.
/// Without the stall bound it waits for 3000 tokens each.
const STALL_BOUND: Duration = Duration::from_secs(240);

/// A TCP connection from `source` to `to`. `tiny` asks for the smallest
/// receive buffer and segment size, so that a client that never reads
/// fills the server's send buffer after a few kilobytes instead of megabytes
/// (the server sizes its buffer from the segment size the client announces).
fn connect_from(source: Ipv4Addr, to: SocketAddr, tiny: bool) -> std::io::Result<TcpStream> {
    fn check(rc: libc::c_int) -> std::io::Result<()> {
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
    fn sockaddr(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
        // SAFETY: sockaddr_in is plain data; all-zero is a valid value.
        let mut a: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_port = port.to_be();
        a.sin_addr = libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        };
        a
    }
    let SocketAddr::V4(to) = to else {
        panic!("IPv4 server address expected")
    };
    // SAFETY: plain socket calls on a descriptor this function owns (the
    // TcpStream closes it on every path).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        check(fd)?;
        let stream = TcpStream::from_raw_fd(fd);
        let set = |level, name, value: libc::c_int| {
            check(libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            ))
        };
        if tiny {
            set(libc::SOL_SOCKET, libc::SO_RCVBUF, 1024)?;
            // 88: the smallest segment Linux takes.
            set(libc::IPPROTO_TCP, libc::TCP_MAXSEG, 88)?;
        }
        let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let from = sockaddr(source, 0);
        check(libc::bind(
            fd,
            (&from as *const libc::sockaddr_in).cast(),
            len,
        ))?;
        let to = sockaddr(*to.ip(), to.port());
        check(libc::connect(
            fd,
            (&to as *const libc::sockaddr_in).cast(),
            len,
        ))?;
        debug_assert_eq!(stream.as_raw_fd(), fd);
        Ok(stream)
    }
}

/// `GET /healthz` from 127.0.0.1 with a short bound: the status, or why not.
fn probe_health(addr: SocketAddr) -> Result<u16, String> {
    let mut c =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(c)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    line.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line: {line:?}"))
}

/// What became of a connection: its answer's status (and head, body), or
/// `None` when it was closed without one.
fn outcome(mut c: TcpStream, within: Duration) -> Option<(u16, String)> {
    c.set_read_timeout(Some(within)).unwrap();
    let mut bytes = Vec::new();
    match c.read_to_end(&mut bytes) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("connection neither answered nor closed in {within:?}: {e}"),
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, text))
}

/// Asserts an OpenAI error answer (head and JSON body in `text`).
#[track_caller]
fn assert_api_error(text: &str, status: u16, kind: &str, code: &str) {
    assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
    let (_, body) = text.split_once("\r\n\r\n").expect("head and body");
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
}

/// A `mlxgate serve` started under `ulimit -n {fds}`, so that a flood can
/// reach the descriptor limit quickly; killed on drop.
struct LimitedServer {
    child: Child,
    addr: SocketAddr,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl LimitedServer {
    fn start(fds: u32, config: &str) -> LimitedServer {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.toml");
        std::fs::write(&cfg, config).unwrap();
        let log = dir.path().join("server.log");
        let port = support::free_port();
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("ulimit -n {fds} && exec \"$0\" \"$@\""))
            .arg(BIN)
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .arg("--port")
            .arg(port.to_string())
            .arg("--model")
            .arg(dir.path().join("no-such-model.gguf"))
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .current_dir(dir.path())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, _) in std::env::vars() {
            if k.starts_with("MLXGATE_") {
                cmd.env_remove(k);
            }
        }
        let child = cmd.spawn().expect("spawn mlxgate");
        let s = LimitedServer {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + PROMPT;
        while probe_health(s.addr) != Ok(200) {
            assert!(
                Instant::now() < deadline,
                "no /healthz; log:\n{}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LimitedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A request head for `POST {path}` announcing `length` body bytes, plus
/// the first `sent` of them.
fn partial_post(path: &str, length: usize, sent: usize) -> Vec<u8> {
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    .into_bytes();
    raw.extend(std::iter::repeat_n(b' ', sent));
    raw
}

#[test]
fn partial_bodies_get_408_and_floods_do_not_stop_healthz() {
    // 256 descriptors: a flood of a few hundred connections would exhaust
    // them, and `accept` with them, without the connection caps.
    let s = LimitedServer::start(
        256,
        "[server]\nrequest_timeout_secs = 2\nkeep_alive_timeout_secs = 3\nmax_connections_per_ip = 16\n",
    );
    assert!(
        s.log_text().contains("max_connections lowered"),
        "the cap follows the descriptor limit; log:\n{}",
        s.log_text()
    );

    // A kept-alive connection left idle after its answer is closed.
    let c = connect_from(Ipv4Addr::LOCALHOST, s.addr, false).unwrap();
    (&c).write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let started = Instant::now();
    let (status, text) = outcome(c, PROMPT).expect("an answer");
    assert_eq!(status, 200, "{text}");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "closed before the idle timeout"
    );

    // A body that never completes: 408 in the OpenAI shape after the
    // request timeout, and the connection closed.
    let mut c = connect_from(Ipv4Addr::LOCALHOST, s.addr, false).unwrap();
    let started = Instant::now();
    c.write_all(&partial_post("/v1/chat/completions", 1000, 10))
        .unwrap();
    let (status, text) = outcome(c, PROMPT).expect("an answer");
    assert_eq!(status, 408, "{text}");
    assert_api_error(&text, 408, "invalid_request_error", "request_timeout");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(started.elapsed() >= Duration::from_millis(1500));

    // A flood of partial bodies from one address: 16 are admitted (and get
    // 408 when their time is up), the rest are refused at once; /healthz from
    // another address answers throughout.
    let flood_started = Instant::now();
    let flood: Vec<TcpStream> = (0..400)
        .map(|_| {
            let mut c = connect_from(Ipv4Addr::new(127, 0, 0, 2), s.addr, false).unwrap();
            c.write_all(&partial_post("/v1/completions", 100_000, 1))
                .unwrap();
            c
        })
        .collect();
    let flood_sent = flood_started.elapsed();
    let probe_started = Instant::now();
    assert_eq!(
        probe_health(s.addr),
        Ok(200),
        "healthz during the flood; log:\n{}",
        s.log_text()
    );
    assert!(probe_started.elapsed() < Duration::from_secs(5));
    let (mut timed_out, mut refused) = (0, 0);
    for c in flood {
        match outcome(c, PROMPT) {
            Some((408, _)) => timed_out += 1,
            Some((429, text)) => {
                assert_api_error(&text, 429, "rate_limit_error", "too_many_connections");
                assert!(
                    text.to_ascii_lowercase().contains("retry-after: 1"),
                    "{text}"
                );
                refused += 1;
            }
            Some((status, text)) => panic!("unexpected {status}: {text}"),
            None => {} // closed unanswered: refusals beyond the refusal budget
        }
    }
    // At most 16 at a time: a slot frees when its holder gets its 408, so
    // a flood that takes longer than the request timeout to send sees more.
    let rounds = flood_sent.as_secs() / 2 + 2;
    assert!(
        timed_out <= 16 * rounds,
        "{timed_out} admitted in {flood_sent:?}: over the per-IP cap"
    );
    assert!(refused > 0, "no 429 among the refusals");

    // From many addresses the total cap (lowered to fit 256 descriptors) is
    // reached: refused with 503, and /healthz is still answered.
    let flood: Vec<TcpStream> = (0..200)
        .map(|i| {
            let ip = Ipv4Addr::new(127, 0, 1, 1 + (i % 12) as u8);
            let mut c = connect_from(ip, s.addr, false).unwrap();
            c.write_all(&partial_post("/v1/completions", 100_000, 1))
                .unwrap();
            c
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while probe_health(s.addr) != Ok(200) {
        assert!(
            Instant::now() < deadline,
            "healthz at the total cap; log:\n{}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut overloaded = 0;
    for c in flood {
        if let Some((503, text)) = outcome(c, PROMPT) {
            assert_api_error(&text, 503, "server_error", "too_many_connections");
            assert!(
                text.to_ascii_lowercase().contains("retry-after: 1"),
                "{text}"
            );
            overloaded += 1;
        }
    }
    assert!(overloaded > 0, "no 503 at the total cap");
    assert_eq!(probe_health(s.addr), Ok(200));
}

/// A chat request that would run for minutes: end-of-sequence banned
/// (SmolLM2: <|endoftext|> 0, <|im_end|> 2), many tokens, and 20 top
/// logprobs so every chunk is a couple of kilobytes.
fn endless_stream(model: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
        "stream": true,
        "max_tokens": 3000,
        "logprobs": true,
        "top_logprobs": 20,
        "logit_bias": {"0": -100, "2": -100},
    }))
    .unwrap()
}

fn post_raw(path: &str, body: &[u8], headers: &[(&str, &str)]) -> Vec<u8> {
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str("\r\n");
    let mut raw = raw.into_bytes();
    raw.extend_from_slice(body);
    raw
}

/// Reads a response head; returns its status line and headers.
fn read_head(r: &mut BufReader<TcpStream>) -> String {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        assert!(
            r.read_line(&mut line).expect("read head") > 0,
            "closed: {head}"
        );
        head.push_str(&line);
        if line == "\r\n" {
            return head;
        }
    }
}

#[test]
fn a_stream_whose_client_stops_reading_is_cancelled_and_frees_its_slot() {
    let (s, model) = support::model_server("[server]\nstream_stall_timeout_secs = 2\n");
    // As many streams as the engine batches at once (16), none ever read.
    let stalled: Vec<TcpStream> = (0..16)
        .map(|_| {
            let mut c = connect_from(Ipv4Addr::LOCALHOST, s.addr, true).unwrap();
            c.write_all(&post_raw(
                "/v1/chat/completions",
                &endless_stream(&model),
                &[],
            ))
            .unwrap();
            c
        })
        .collect();
    // A small request behind them: it only runs once a batch slot frees,
    // which without the stall bound takes minutes (3000 tokens each).
    let small = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
    });
    std::thread::sleep(Duration::from_millis(500));
    let body = serde_json::to_vec(&small).unwrap();
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(&post_raw(
        "/v1/chat/completions",
        &body,
        &[("connection", "close")],
    ))
    .unwrap();
    let (status, text) = outcome(c, STALL_BOUND)
        .unwrap_or_else(|| panic!("small request closed; log:\n{}", s.log_text()));
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("chat.completion"), "{text}");
    // Every stalled stream was cut off, not only the one whose slot the
    // small request took. (Their sockets are not read here: the server's
    // orphaned ends give up on a client that never reads.)
    let deadline = Instant::now() + STALL_BOUND;
    while s
        .log_text()
        .matches("client stopped reading a streamed answer")
        .count()
        < 16
    {
        assert!(
            Instant::now() < deadline,
            "not every stream was cut off; log:\n{}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(stalled);
}

#[test]
fn per_key_concurrency_cap_gives_429_and_spares_other_keys() {
    let key = |id: &str, extra: &str| {
        let hash = support::run_cli(&["keys", "hash", id], &[]).1;
        format!(
            "[[keys]]\nid = \"{id}\"\ntenant = \"t\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n{extra}",
            hash.trim()
        )
    };
    let config = format!(
        "[server]\nmax_concurrent_requests_per_key = 1\n{}{}",
        key("key-a", "max_concurrent_requests = 2\n"),
        key("key-b", "")
    );
    let (s, model) = support::model_server(&config);
    let auth_a = [("authorization", "Bearer key-a")];
    let open_stream = || {
        let mut c = TcpStream::connect(s.addr).unwrap();
        c.set_read_timeout(Some(PROMPT)).unwrap();
        c.write_all(&post_raw(
            "/v1/chat/completions",
            &endless_stream(&model),
            &auth_a,
        ))
        .unwrap();
        let mut r = BufReader::new(c);
        let head = read_head(&mut r);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        r
    };
    // key-a's override allows 2 at once; both streams hold their slot.
    let first = open_stream();
    let _second = open_stream();
    let small = |auth: &str| {
        let body = serde_json::to_vec(&json!({
            "model": model,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 2,
        }))
        .unwrap();
        let bearer = format!("Bearer {auth}");
        support::raw_exchange(
            s.addr,
            &post_raw(
                "/v1/chat/completions",
                &body,
                &[("authorization", &bearer), ("connection", "close")],
            ),
        )
        .unwrap()
    };
    let third = small("key-a");
    let e = third.api_error(429, "rate_limit_error", "concurrency_limit_exceeded");
    assert!(e["message"].as_str().unwrap().contains("key-a"), "{e}");
    assert_eq!(third.header("retry-after"), Some("1"));
    // Another key is unaffected.
    let other = small("key-b");
    assert_eq!(other.status, 200, "{}", other.text());
    // Hanging up one stream frees its slot.
    drop(first);
    let deadline = Instant::now() + PROMPT;
    loop {
        let r = small("key-a");
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429, "{}", r.text());
        assert!(
            Instant::now() < deadline,
            "slot not freed; log:\n{}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
