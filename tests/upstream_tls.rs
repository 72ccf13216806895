//! TLS at both ends, against the real binary: a second mlxgate serves the
//! model over HTTPS (`--tls-cert`/`--tls-key`, a certificate from a CA made
//! here), and the gateway under test proxies to it as an `https://`
//! upstream trusting that CA (`ca_file`). Whole and streamed answers come
//! through unchanged; an upstream whose certificate the configured CA did
//! not sign is refused with a 502 naming TLS; a client that never
//! finishes its handshake is closed after the keep-alive timeout; bad TLS
//! settings stop the gateway at start with a message naming the entry.

#[path = "support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use support::{Server, ServerBuilder, real_model, run_cli};

/// A CA and a certificate it signed for `localhost` and 127.0.0.1, as PEM
/// files in `dir`: `<name>-ca.pem`, `<name>-cert.pem`, `<name>-key.pem`.
fn make_pki(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} test CA"));
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let params =
        rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    let paths = (
        dir.join(format!("{name}-ca.pem")),
        dir.join(format!("{name}-cert.pem")),
        dir.join(format!("{name}-key.pem")),
    );
    std::fs::write(&paths.0, ca_cert.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

/// One HTTPS request trusting `ca`; returns the status and the body.
fn https(
    addr: SocketAddr,
    ca: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Vec<u8>) {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    #[allow(deprecated)] // ring, as the gateway uses (see util/tls.rs)
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        tls,
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(tls);
    let mut status = String::new();
    reader.read_line(&mut status).unwrap();
    let mut rest = Vec::new();
    // The server closes after answering; rustls may see the TCP close
    // without close_notify only if the server misbehaves.
    reader.read_to_end(&mut rest).unwrap();
    let code = status.split_whitespace().nth(1).unwrap().parse().unwrap();
    let text = String::from_utf8_lossy(&rest);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (code, body.into_bytes())
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// The model server behind TLS, and its model id, once it is ready.
fn tls_model_server(cert: &Path, key: &Path, ca: &Path) -> (Server, String) {
    let server = ServerBuilder::new()
        .model(real_model())
        .arg("--tls-cert")
        .arg(cert.to_str().unwrap())
        .arg("--tls-key")
        .arg(key.to_str().unwrap())
        .spawn();
    let body = https_ok(&server, ca, "/readyz");
    let v: Value = serde_json::from_slice(&body).unwrap();
    let model = v["model"].as_str().unwrap().to_owned();
    (server, model)
}

/// The body of `GET path` over HTTPS once the server answers it 200.
fn https_ok(server: &Server, ca: &Path, path: &str) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let got = std::panic::catch_unwind(|| https(server.addr, ca, "GET", path, None));
        if let Ok((200, body)) = got {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "the TLS server never answered {path}; log:\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn chat(model: &str, stream: bool) -> Value {
    json!({
        "model": model, "max_tokens": 12, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": "Name a colour."}],
    })
}

/// The text of an SSE chat stream's deltas, and whether it ended with [DONE].
fn streamed_text(sse: &str) -> (String, bool) {
    let mut text = String::new();
    let mut done = false;
    for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
    }
    (text, done)
}

#[test]
fn https_upstreams_proxy_whole_and_streamed_answers_and_refuse_a_wrong_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_pki(dir.path(), "good");
    let (other_ca, _, _) = make_pki(dir.path(), "other");
    let (upstream, model) = tls_model_server(&cert, &key, &ca);
    // Plain HTTP to the TLS listener gets no HTTP answer.
    let plain = support::try_request(upstream.addr, "GET", "/healthz", &[], None);
    assert!(plain.is_err() || plain.unwrap().status != 200);

    let port = upstream.addr.port();
    let config = format!(
        "[[upstreams]]\nname = \"secure\"\nbase_url = \"https://localhost:{port}/v1\"\n\
         ca_file = \"{}\"\nmodels = [\"{model}\"]\n\
         [[upstreams]]\nname = \"untrusted\"\nbase_url = \"https://localhost:{port}/v1\"\n\
         ca_file = \"{}\"\nmodels = [\"via-wrong-ca\"]\n",
        ca.display(),
        other_ca.display()
    );
    let gateway = ServerBuilder::new().config(&config).start();

    let direct = https(
        upstream.addr,
        &ca,
        "POST",
        "/v1/chat/completions",
        Some(&chat(&model, false)),
    );
    assert_eq!(direct.0, 200, "{}", String::from_utf8_lossy(&direct.1));
    let direct: Value = serde_json::from_slice(&direct.1).unwrap();
    let want = direct["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!want.is_empty());

    for _ in 0..3 {
        let whole = gateway.post_json("/v1/chat/completions", &chat(&model, false));
        assert_eq!(
            whole.status,
            200,
            "{}\n{}",
            whole.text(),
            gateway.log_text()
        );
        assert_eq!(whole.header("x-mlxgate-upstream"), Some("secure"));
        assert_eq!(whole.json()["choices"][0]["message"]["content"], want);
    }
    let streamed = gateway.post_json("/v1/chat/completions", &chat(&model, true));
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    assert!(
        streamed
            .header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_eq!(streamed_text(&streamed.text()), (want.to_owned(), true));
    // The gateway asked the upstream for usage; the client, which did not,
    // gets no usage chunk.
    assert!(
        !streamed.text().contains("\"choices\":[]"),
        "{}",
        streamed.text()
    );

    // Every proxied answer's usage was counted, the streamed one included.
    let per = &direct["usage"];
    let metrics = gateway.get("/metrics").text();
    for (kind, field) in [
        ("prompt", "prompt_tokens"),
        ("completion", "completion_tokens"),
    ] {
        // Summed over tenants and models: the upstream is the backend.
        let series = format!("backend=\"secure\",kind=\"{kind}\"}} ");
        let counted: u64 = metrics
            .lines()
            .filter(|l| l.starts_with("mlxgate_tokens_total{"))
            .filter_map(|l| l.split_once(&series))
            .map(|(_, n)| n.parse::<u64>().unwrap())
            .sum();
        assert_eq!(
            counted,
            4 * per[field].as_u64().unwrap(),
            "{kind}\n{metrics}"
        );
    }

    let refused = gateway.post_json("/v1/chat/completions", &chat("via-wrong-ca", false));
    let e = refused.api_error(502, "server_error", "upstream_unavailable");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("`untrusted`") && message.contains("TLS"),
        "{message}"
    );
    assert!(
        !message.contains(&port.to_string()),
        "the address stays in the log: {message}"
    );
}

#[test]
fn a_client_that_never_finishes_its_handshake_is_closed_after_the_keep_alive_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_pki(dir.path(), "edge");
    let server = ServerBuilder::new()
        .config("[server]\nkeep_alive_timeout_secs = 1\n")
        .arg("--tls-cert")
        .arg(cert.to_str().unwrap())
        .arg("--tls-key")
        .arg(key.to_str().unwrap())
        .spawn();
    https_ok(&server, &ca, "/healthz");
    // Connected, then silent: no ClientHello ever comes.
    let mut silent = TcpStream::connect(server.addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let started = Instant::now();
    let read = silent.read(&mut [0u8; 16]);
    let waited = started.elapsed();
    let closed = match &read {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    };
    assert!(closed, "the silent connection was not closed: {read:?}");
    assert!(
        (Duration::from_millis(900)..Duration::from_secs(8)).contains(&waited),
        "closed after {waited:?}, not after the 1 s keep-alive timeout"
    );
    // Its slot is free and the server serves on.
    assert_eq!(https(server.addr, &ca, "GET", "/healthz", None).0, 200);
}

#[test]
fn bad_tls_settings_stop_the_gateway_at_start_naming_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let cases = [
        (
            "[[upstreams]]\nname = \"hosted\"\nbase_url = \"https://api.example.com/v1\"\nca_file = \"/no/such/ca.pem\"\n",
            &["`hosted`", "/no/such/ca.pem"][..],
        ),
        (
            "[[upstreams]]\nname = \"plain\"\nbase_url = \"http://127.0.0.1:9/v1\"\nca_file = \"ca.pem\"\n",
            &["`plain`", "https://"][..],
        ),
        (
            "[[upstreams]]\nname = \"bad-url\"\nbase_url = \"htps://x/v1\"\n",
            &["`bad-url`", "https://"][..],
        ),
        (
            "[[upstreams]]\nname = \"twice\"\nbase_url = \"http://a/v1\"\n\
             [[upstreams]]\nname = \"twice\"\nbase_url = \"http://b/v1\"\n",
            &["`twice`", "twice"][..],
        ),
        (
            "[server]\ntls_cert = \"/no/such/cert.pem\"\ntls_key = \"/no/such/key.pem\"\n",
            &["/no/such/cert.pem"][..],
        ),
    ];
    for (toml, wanted) in cases {
        std::fs::write(&config, toml).unwrap();
        let (status, _, stderr) = run_cli(
            &["serve", "--config", config.to_str().unwrap(), "--port", "1"],
            &[],
        );
        assert!(!status.success(), "{toml} was accepted");
        for w in wanted {
            assert!(stderr.contains(w), "{toml}: {w} not in {stderr}");
        }
    }
    let (status, _, stderr) = run_cli(&["serve", "--tls-cert", "c.pem", "--port", "1"], &[]);
    assert!(
        !status.success() && stderr.contains("--tls-key"),
        "{stderr}"
    );
}
