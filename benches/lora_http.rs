//! Adapters over HTTP: single-stream decode speed of the same adapter
//! chosen three ways, through the release `mlxgate` binary on loopback:
//!
//! - **plain**: the request turns adapters off (`"adapter": "none"`);
//! - **named**: the request names the adapter (`"adapter": "a"`);
//! - **selected**: the request names none and the `adapter-by-tenant` Wasm
//!   policy, bound as the adapter selector, picks it for the key's tenant.
//!
//! All three come from the same key with the policy bound, in interleaved
//! rounds; each figure is the median of decode tokens/s after the first
//! token (streamed, `stream_options.include_usage` for the count). The named
//! and selected answers must be the same text (same adapter, greedy).
//!
//! ```text
//! scripts/build-policies.sh
//! cargo bench -p mlxgate --bench lora_http
//! MLXGATE_BENCH_MODEL=models/qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \
//!     cargo bench -p mlxgate --bench lora_http
//! ```

#[path = "common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use mlxgate::engine::LoadedModel;
use mlxgate::fixtures::{LoraSpec, write_random_lora};
use mlxgate::http::auth::KeyHash;
use serde_json::{Value, json};

const ROUNDS: usize = 5;
const TOKENS: usize = 48;
const KEY: &str = "bench-lora-acme-key";
const ADMIN: &str = "bench-lora-admin-key";

fn main() {
    let model = common::bench_model();
    let loaded = LoadedModel::load(&model).expect("load the model (run scripts/setup.sh)");
    let spec = LoraSpec::for_config(&loaded.transformer.config, 20.0, 0.01);
    // End-of-text ids are suppressed so that every answer has TOKENS tokens.
    let bias: serde_json::Map<String, Value> = loaded
        .codec
        .eos_ids
        .iter()
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    let id = loaded.id.clone();
    drop(loaded);

    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("adapters");
    write_random_lora(&store.join("a"), &spec).expect("write adapter");
    let gateway = Gateway::start(dir.path(), &model, &store);
    gateway.bind_selector();
    println!(
        "{}: adapter rank {} on 7 projections x {} layers",
        model.display(),
        spec.rank,
        spec.layers
    );

    let body = |adapter: Option<&str>| {
        let mut b = json!({
            "model": id,
            "prompt": "Tell me a story about a lighthouse keeper.",
            "max_tokens": TOKENS,
            "temperature": 0,
            "logit_bias": bias,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(a) = adapter {
            b["adapter"] = json!(a);
        }
        b.to_string()
    };
    let ways = [
        ("plain", body(Some("none"))),
        ("named", body(Some("a"))),
        ("selected", body(None)),
    ];
    // Warm-up, and the check that the policy's choice is the named adapter.
    let texts: Vec<String> = ways.iter().map(|(_, b)| gateway.stream(b).text).collect();
    assert_eq!(texts[1], texts[2], "the policy should pick adapter a");
    assert_ne!(texts[0], texts[1], "the adapter should change the answer");

    let mut rates = vec![Vec::new(); ways.len()];
    for _ in 0..ROUNDS {
        for (i, (_, b)) in ways.iter().enumerate() {
            rates[i].push(gateway.stream(b).rate);
        }
    }
    let medians: Vec<f64> = rates.into_iter().map(median).collect();
    for ((name, _), m) in ways.iter().zip(&medians) {
        println!(
            "{name:>9}: {m:.1} tok/s decode ({:.2}x plain)",
            m / medians[0]
        );
    }
    println!(
        "selected by the policy vs named in the request: {:.2}x",
        medians[2] / medians[1]
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One streamed answer: its text and decode tokens/s after the first token.
struct Streamed {
    text: String,
    rate: f64,
}

struct Gateway {
    child: Child,
    addr: SocketAddr,
}

impl Gateway {
    fn start(dir: &Path, model: &Path, store: &Path) -> Gateway {
        let port = common::free_port();
        let config = dir.join("gateway.toml");
        std::fs::write(
            &config,
            format!(
                "[adapters]\nstores = [\"{}\"]\n\n[[adapters.mount]]\nid = \"a\"\npath = \"a\"\n\n\
                 [[keys]]\nid = \"acme\"\ntenant = \"acme\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
                store.display(),
                KeyHash::of(KEY).to_hex()
            ),
        )
        .expect("write config");
        let bin = Path::new(env!("CARGO_BIN_EXE_mlxgate"));
        let child = common::spawn_gateway(bin, &config, port, &dir.join("data"), model, ADMIN);
        let gateway = Gateway {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while gateway.call("GET", "/readyz", ADMIN, b"").0 != 200 {
            assert!(Instant::now() < deadline, "mlxgate did not get ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        gateway
    }

    /// Uploads `adapter-by-tenant` (tenant acme -> adapter a) and binds it
    /// as the adapter selector.
    fn bind_selector(&self) {
        let wasm = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../policies/target/wasm32-unknown-unknown/release/adapter_by_tenant.wasm");
        let bytes = std::fs::read(&wasm).unwrap_or_else(|e| {
            panic!(
                "{} missing ({e}): run scripts/build-policies.sh",
                wasm.display()
            )
        });
        let config = "%7B%22tenants%22%3A%7B%22acme%22%3A%5B%22a%22%5D%7D%7D";
        let (status, text) = self.call(
            "PUT",
            &format!("/admin/policies/by-tenant?kind=adapter-selector&config={config}"),
            ADMIN,
            &bytes,
        );
        assert!(status == 200 || status == 201, "upload: {status} {text}");
        let bind = json!({"policy": "by-tenant"}).to_string();
        let (status, text) = self.call(
            "PUT",
            "/admin/bindings/adapter-selector",
            ADMIN,
            bind.as_bytes(),
        );
        assert_eq!(status, 200, "bind: {text}");
    }

    /// A whole request with `key`: status and answer text (0 when nothing
    /// listens yet).
    fn call(&self, method: &str, path: &str, key: &str, body: &[u8]) -> (u16, String) {
        let auth = format!("Bearer {key}");
        let headers = [
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
        ];
        common::request(self.addr, method, path, &headers, body).unwrap_or((0, String::new()))
    }

    /// Streams a completion; times from its first text to its end.
    fn stream(&self, body: &str) -> Streamed {
        let mut s = TcpStream::connect(self.addr).expect("connect");
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        s.write_all(head.as_bytes()).expect("write");
        s.write_all(body.as_bytes()).expect("write");
        let mut r = BufReader::new(s);
        let (mut text, mut first, mut tokens) = (String::new(), None, None);
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line).expect("read") == 0 {
                panic!("the stream ended before [DONE]; so far: {text}");
            }
            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                break;
            }
            let event: Value = serde_json::from_str(data).expect("event JSON");
            if let Some(piece) = event["choices"][0]["text"].as_str()
                && !piece.is_empty()
            {
                first.get_or_insert_with(Instant::now);
                text.push_str(piece);
            }
            if let Some(n) = event["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n as usize);
            }
        }
        let secs = first.expect("no text streamed").elapsed().as_secs_f64();
        let tokens = tokens.expect("usage in the stream");
        assert_eq!(tokens, TOKENS, "every answer runs to max_tokens");
        Streamed {
            text,
            rate: (tokens - 1) as f64 / secs,
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
