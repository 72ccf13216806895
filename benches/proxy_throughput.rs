//! Proxy throughput on loopback: the gateway (release binary, as its own
//! process) forwarding `POST /v1/chat/completions` to a trivial upstream (a
//! hyper server answering a fixed small JSON) with no router policy bound
//! (static route from `[[upstreams]] models`); with the `tenant-router` Wasm
//! policy bound (it declares its decision inputs, so its decisions are
//! reused); with the `least-loaded` policy bound (it reads the backends'
//! load, so the guest is called for every request); and nginx proxying the
//! same upstream in the same run.
//!
//! Run: `scripts/bench-proxy.sh` (installs `wrk` and `nginx-light` when
//! missing, builds the policies, then `cargo bench -p mlxgate --bench
//! proxy_throughput`). Load: `wrk`, keep-alive connections, fixed duration;
//! the targets are measured in interleaved rounds so machine noise hits each
//! alike; the medians are reported (`PROXY_THROUGHPUT_ROUNDS`, default 5;
//! `PROXY_THROUGHPUT_GATEWAY` runs another `mlxgate` binary).
//! `PROXY_THROUGHPUT_PROFILE=none`,
//! `=policy`, `=called` or `=nginx` only loads that target, for a profiler.
//! `PROXY_THROUGHPUT_TLS=1` puts the upstream behind TLS (HTTP/1.1, a CA
//! made for the run): the gateway and nginx both verify it and keep their
//! TLS connections alive.
//!
//! `PROXY_THROUGHPUT_LIMITS=1` measures `[limits]` instead: the gateway
//! without limits, with limits kept in memory, and with limits kept in a
//! `redis-server` started for the run (when installed), each its own
//! process, in interleaved rounds; every request is checked against a key's
//! and a tenant's counters and its tokens charged (limits high enough that
//! nothing is refused).
//!
//! `PROXY_THROUGHPUT_CONSOLE=1` measures the web console's cost to the API:
//! the gateway with `[console] enabled = false` against the default (console
//! on), each its own process, in interleaved rounds.

#[path = "common/mod.rs"]
mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Rounds unless `PROXY_THROUGHPUT_ROUNDS` says otherwise (more rounds give
/// steadier medians on a noisy machine).
const ROUNDS: usize = 5;
const SECS: u32 = 5;
const CONNECTIONS: u32 = 32;
const KEY: &str = "bench-infer-key";
const ADMIN: &str = "bench-admin-key";
const ANSWER: &[u8] = br#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
/// Router policies uploaded to the gateway: one whose decisions are reused,
/// one called for every request.
const REUSED: &str = "tenants";
const CALLED: &str = "least-loaded";
const REQUEST: &str =
    r#"{"model":"bench-model","messages":[{"role":"user","content":"hi"}],"max_tokens":16}"#;

fn main() {
    let (Some(wrk), Some(nginx)) = (find_tool("wrk"), find_tool("nginx")) else {
        eprintln!(
            "proxy_throughput needs wrk and nginx: run scripts/bench-proxy.sh (installs them)"
        );
        std::process::exit(2);
    };
    let dir = tempfile::tempdir().expect("temp dir");
    // `PROXY_THROUGHPUT_TLS=1`: the upstream speaks HTTPS (HTTP/1.1 by
    // ALPN, a certificate from a CA made here), and both proxies verify it.
    let tls = std::env::var("PROXY_THROUGHPUT_TLS").is_ok_and(|v| v == "1");
    let pki = tls.then(|| make_pki(dir.path()));
    let upstream = start_upstream(pki.as_ref());
    if std::env::var("PROXY_THROUGHPUT_LIMITS").is_ok_and(|v| v == "1") {
        return limits_rounds(&wrk, dir.path(), upstream);
    }
    if std::env::var("PROXY_THROUGHPUT_CONSOLE").is_ok_and(|v| v == "1") {
        let targets = vec![
            (
                "console off",
                Gateway::start(
                    &dir.path().join("off"),
                    upstream,
                    None,
                    "[console]\nenabled = false\n",
                ),
            ),
            (
                "console on",
                Gateway::start(&dir.path().join("on"), upstream, None, ""),
            ),
        ];
        compare_rounds(&wrk, dir.path(), &targets);
        println!("\ntarget: console on = console off, within the rounds' noise");
        return;
    }
    let gateway = Gateway::start(dir.path(), upstream, pki.as_ref(), "");
    let nginx = Nginx::start(&nginx, dir.path(), upstream, pki.as_ref());
    if tls {
        println!("upstream over TLS (HTTP/1.1), verified by both proxies");
    }
    let script = wrk_script(dir.path());
    let url = |addr: SocketAddr| format!("http://{addr}/v1/chat/completions");

    // Warm-up: connections, pools, warm policy instances.
    for router in [REUSED, CALLED] {
        gateway.bind(Some(router));
        load(&wrk, &script, &url(gateway.addr), 1);
    }
    load(&wrk, &script, &url(nginx.addr), 1);

    // `PROXY_THROUGHPUT_PROFILE=none|policy|called|nginx`: only load that
    // target, for 30 s, printing its pids, for a profiler to attach to.
    if let Ok(mode) = std::env::var("PROXY_THROUGHPUT_PROFILE") {
        let (addr, pids) = if mode == "nginx" {
            (nginx.addr, nginx.pids())
        } else {
            gateway.bind(match mode.as_str() {
                "policy" => Some(REUSED),
                "called" => Some(CALLED),
                _ => None,
            });
            (gateway.addr, vec![gateway.child.id()])
        };
        println!("pids {pids:?}, mode {mode}");
        let (rps, _) = load(&wrk, &script, &url(addr), 30);
        println!("{rps:.0} requests/s");
        return;
    }
    let gw_pids = || vec![gateway.child.id()];
    let nginx_pids = || nginx.pids();
    // Samples per target: no router, REUSED bound, CALLED bound, nginx.
    let mut samples: [Vec<Sample>; 4] = Default::default();
    let rounds = std::env::var("PROXY_THROUGHPUT_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|r| *r > 0)
        .unwrap_or(ROUNDS);
    for round in 1..=rounds {
        // Each round starts with another target, so that no target always
        // follows the same one.
        for t in (0..4).map(|i| (i + round - 1) % 4) {
            let sample = match t {
                3 => measure(&wrk, &script, &url(nginx.addr), &nginx_pids),
                _ => {
                    gateway.bind([None, Some(REUSED), Some(CALLED)][t]);
                    measure(&wrk, &script, &url(gateway.addr), &gw_pids)
                }
            };
            samples[t].push(sample);
        }
        let [none, policy, called, reference] = &samples;
        let last = |v: &[Sample]| v[round - 1];
        println!(
            "round {round}: gateway, no policy {}; + tenant-router {}; + least-loaded {}; nginx {}",
            last(none),
            last(policy),
            last(called),
            last(reference)
        );
    }
    let med = |v: &[Sample], f: fn(&Sample) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).collect();
        median(&mut x)
    };
    let [none, policy, called, reference] = &samples;
    let rps = |v: &[Sample]| med(v, |s| s.rps);
    let cpu = |v: &[Sample]| med(v, |s| s.cpu_us);
    let (n, p, c, x) = (rps(none), rps(policy), rps(called), rps(reference));
    let (cn, cp, cc, cx) = (cpu(none), cpu(policy), cpu(called), cpu(reference));
    println!(
        "\n{rounds} rounds of {SECS} s, wrk 1 thread, {CONNECTIONS} keep-alive connections; medians:\n"
    );
    println!("| target | requests/s | vs nginx | proxy CPU per request | vs nginx |");
    println!("| --- | --- | --- | --- | --- |");
    println!("| nginx proxy_pass (keepalive upstream) | {x:.0} | 1.00x | {cx:.1} us | 1.00x |");
    println!(
        "| gateway, no policy (static route) | {n:.0} | {:.2}x | {cn:.1} us | {:.2}x |",
        n / x,
        cn / cx
    );
    println!(
        "| gateway, tenant-router bound (decisions reused) | {p:.0} | {:.2}x | {cp:.1} us | {:.2}x |",
        p / x,
        cp / cx
    );
    println!(
        "| gateway, least-loaded bound (guest called per request) | {c:.0} | {:.2}x | {cc:.1} us | {:.2}x |",
        c / x,
        cc / cx
    );
    println!(
        "\ntenant-router vs none: throughput {:+.1}%, CPU per request {:+.1}% (target: loss <= 5%)\n\
         least-loaded vs none: throughput {:+.1}%, CPU per request {:+.1}%\n\
         gateway (tenant-router) vs nginx: throughput {:.2}x (target >= 0.8x), CPU per request {:.2}x",
        (p / n - 1.0) * 100.0,
        (cp / cn - 1.0) * 100.0,
        (c / n - 1.0) * 100.0,
        (cc / cn - 1.0) * 100.0,
        p / x,
        cp / cx
    );
    // Ratios within each round: the targets of one round share its machine
    // load, so these move less than ratios of medians.
    let paired = |a: &[Sample], b: &[Sample]| {
        let mut r: Vec<f64> = a.iter().zip(b).map(|(a, b)| a.rps / b.rps).collect();
        let m = median(&mut r);
        format!("{m:.3} ({:.3}-{:.3})", r[0], r[r.len() - 1])
    };
    println!(
        "per-round throughput ratios, median (range): tenant-router / none {}; least-loaded / none {}; \
         tenant-router / nginx {}; none / nginx {}",
        paired(policy, none),
        paired(called, none),
        paired(policy, reference),
        paired(none, reference)
    );
    drop(gateway);
    drop(nginx);
}

/// The wrk script of the bench's request (in `dir`).
fn wrk_script(dir: &Path) -> PathBuf {
    let script = dir.join("post.lua");
    std::fs::write(
        &script,
        format!(
            "wrk.method = \"POST\"\nwrk.body = '{REQUEST}'\n\
             wrk.headers[\"Content-Type\"] = \"application/json\"\n\
             wrk.headers[\"Authorization\"] = \"Bearer {KEY}\"\n"
        ),
    )
    .expect("write wrk script");
    script
}

/// Limits in force on every request of the bench's key, never refusing.
const LIMITS: &str = "[limits.keys.bench]\nrequests_per_minute = 1000000000\n\
    [limits.tenants.bench]\nrequests_per_minute = 1000000000\ntokens_per_minute = 1000000000\n";

/// `PROXY_THROUGHPUT_LIMITS=1`: the gateway without limits, with limits in
/// memory and with limits in Redis, in interleaved rounds.
fn limits_rounds(wrk: &Path, dir: &Path, upstream: SocketAddr) {
    let mut targets = vec![
        (
            "no limits",
            Gateway::start(&dir.join("off"), upstream, None, ""),
        ),
        (
            "limits in memory",
            Gateway::start(&dir.join("memory"), upstream, None, LIMITS),
        ),
    ];
    let redis = find_tool("redis-server").map(|bin| {
        let port = common::free_port();
        let child = Command::new(bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("start redis-server");
        common::wait_listening(SocketAddr::from(([127, 0, 0, 1], port)), "redis-server");
        (child, port)
    });
    match &redis {
        Some((_, port)) => {
            let config = format!(
                "[limits]\nbackend = \"redis\"\nredis_url = \"redis://127.0.0.1:{port}\"\n{LIMITS}"
            );
            targets.push((
                "limits in Redis",
                Gateway::start(&dir.join("redis"), upstream, None, &config),
            ));
        }
        None => println!("redis-server not installed: the Redis target is left out"),
    }
    compare_rounds(wrk, dir, &targets);
    println!("\ntarget: limits in memory >= 0.95x of no limits");
    drop(targets);
    if let Some((mut child, _)) = redis {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Loads each of `targets` in turn, round after round (the order rotating,
/// so machine noise hits each alike), and prints each round and a table of
/// medians against the first target.
fn compare_rounds(wrk: &Path, dir: &Path, targets: &[(&str, Gateway)]) {
    let script = wrk_script(dir);
    let url = |addr: SocketAddr| format!("http://{addr}/v1/chat/completions");
    for (_, g) in targets {
        load(wrk, &script, &url(g.addr), 1);
    }
    let rounds = std::env::var("PROXY_THROUGHPUT_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|r| *r > 0)
        .unwrap_or(ROUNDS);
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); targets.len()];
    for round in 1..=rounds {
        let n = targets.len();
        for t in (0..n).map(|i| (i + round - 1) % n) {
            let g = &targets[t].1;
            samples[t].push(measure(wrk, &script, &url(g.addr), &|| vec![g.child.id()]));
        }
        let line: Vec<String> = targets
            .iter()
            .zip(&samples)
            .map(|((name, _), s)| format!("{name} {}", s[round - 1]))
            .collect();
        println!("round {round}: {}", line.join("; "));
    }
    println!(
        "\n{rounds} rounds of {SECS} s, wrk 1 thread, {CONNECTIONS} keep-alive connections; medians:\n"
    );
    println!(
        "| target | requests/s | vs {} | per-round ratio, median (range) |",
        targets[0].0
    );
    println!("| --- | --- | --- | --- |");
    let rps = |v: &[Sample]| median(&mut v.iter().map(|s| s.rps).collect::<Vec<_>>());
    let base = rps(&samples[0]);
    for ((name, _), s) in targets.iter().zip(&samples) {
        let mut r: Vec<f64> = s
            .iter()
            .zip(&samples[0])
            .map(|(a, b)| a.rps / b.rps)
            .collect();
        let m = median(&mut r);
        println!(
            "| {name} | {:.0} | {:.2}x | {m:.3} ({:.3}-{:.3}) |",
            rps(s),
            rps(s) / base,
            r[0],
            r[r.len() - 1]
        );
    }
}

/// One load run: throughput, and the proxy's own CPU time per request
/// (user + system, all its processes), which other load on a shared machine
/// disturbs much less than throughput.
#[derive(Clone, Copy)]
struct Sample {
    rps: f64,
    cpu_us: f64,
}

impl std::fmt::Display for Sample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.0} req/s, {:.1} us CPU/req", self.rps, self.cpu_us)
    }
}

fn measure(wrk: &Path, script: &Path, url: &str, pids: &dyn Fn() -> Vec<u32>) -> Sample {
    let before = cpu_ticks(&pids());
    let (rps, requests) = load(wrk, script, url, SECS);
    let after = cpu_ticks(&pids());
    // USER_HZ is 100 on Linux: one tick is 10 ms.
    let cpu_us = after.saturating_sub(before) as f64 * 10_000.0 / requests.max(1.0);
    Sample { rps, cpu_us }
}

/// utime + stime of `pids`, in clock ticks.
fn cpu_ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|stat| {
            // Fields after the parenthesised command name; utime and stime
            // are fields 14 and 15 of the whole line.
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

/// Processes whose parent is `parent`.
fn children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                })
                == Some(parent)
        })
        .collect()
}

fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Runs wrk for `secs`: (requests/s, requests). Socket errors, or non-2xx
/// answers above 0.1%, abort the bench (a broken setup must not pass for a
/// slow one); fewer non-2xx answers are printed.
fn load(wrk: &Path, script: &Path, url: &str, secs: u32) -> (f64, f64) {
    let out = Command::new(wrk)
        .args(["-t1", &format!("-c{CONNECTIONS}"), &format!("-d{secs}s")])
        .arg("-s")
        .arg(script)
        .arg(url)
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "wrk failed: {text}");
    assert!(
        !text.contains("Socket errors"),
        "socket errors under load against {url}:\n{text}"
    );
    let field = |prefix: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    let rps =
        field("Requests/sec:").unwrap_or_else(|| panic!("no Requests/sec in wrk output:\n{text}"));
    let requests = text
        .lines()
        .find(|l| l.contains(" requests in "))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no request count in wrk output:\n{text}"));
    if let Some(bad) = field("Non-2xx or 3xx responses:") {
        println!("  {bad} non-2xx answers of {requests} from {url}");
        assert!(
            bad <= requests / 1000.0,
            "too many errors under load:\n{text}\none answer: {:?}\nnginx's error log:\n{}",
            one_answer(url),
            NGINX_LOG
                .get()
                .and_then(|p| std::fs::read_to_string(p).ok())
                .unwrap_or_default()
        );
    }
    (rps, requests)
}

/// One bench request to `url` (`http://addr/path`): what a failing
/// target answers, for the bench's error message.
fn one_answer(url: &str) -> std::io::Result<(u16, String)> {
    let rest = url.trim_start_matches("http://");
    let (addr, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let addr: SocketAddr = addr.parse().map_err(std::io::Error::other)?;
    let auth = format!("Bearer {KEY}");
    let headers = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    common::request(addr, "POST", path, &headers, REQUEST.as_bytes())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A CA and a certificate it signed for `localhost`, as PEM files.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn make_pki(dir: &Path) -> Pki {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    // Distinct names: OpenSSL takes a certificate whose issuer is its own
    // subject for a self-signed one.
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "mlxgate bench CA");
    let ca_cert = ca.self_signed(&ca_key).expect("CA");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().expect("key");
    let mut leaf = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    let cert = leaf.signed_by(&key, &issuer).expect("certificate");
    let pki = Pki {
        ca: dir.join("ca.pem"),
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    };
    std::fs::write(&pki.ca, ca_cert.pem()).expect("write CA");
    std::fs::write(&pki.cert, cert.pem()).expect("write certificate");
    std::fs::write(&pki.key, key.serialize_pem()).expect("write key");
    pki
}

/// The trivial upstream: one runtime thread, a fixed JSON answer; over TLS
/// with `pki`.
fn start_upstream(pki: Option<&Pki>) -> SocketAddr {
    use http_body_util::{BodyExt, Full};
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;

    let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
    let addr = listener.local_addr().expect("upstream addr");
    listener.set_nonblocking(true).expect("nonblocking");
    let acceptor = pki.map(|p| {
        let config = mlxgate::util::tls::server_config(&p.cert, &p.key).expect("TLS config");
        tokio_rustls::TlsAcceptor::from(config)
    });
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            while let Ok((s, _)) = listener.accept().await {
                let _ = s.set_nodelay(true);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let svc = service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                        // Read the body so the connection can be reused.
                        let _ = req.into_body().collect().await;
                        let mut r =
                            hyper::Response::new(Full::new(bytes::Bytes::from_static(ANSWER)));
                        r.headers_mut().insert(
                            http::header::CONTENT_TYPE,
                            http::HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, std::convert::Infallible>(r)
                    });
                    let http = hyper::server::conn::http1::Builder::new();
                    let _ = match acceptor {
                        None => http.serve_connection(TokioIo::new(s), svc).await,
                        Some(a) => match a.accept(s).await {
                            Ok(tls) => http.serve_connection(TokioIo::new(tls), svc).await,
                            Err(_) => return,
                        },
                    };
                });
            }
        });
    });
    addr
}

/// A raw HTTP/1.1 exchange on a fresh connection: (status, body).
/// An admin request to the gateway: status and answer text.
fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let auth = format!("Bearer {ADMIN}");
    common::request(
        addr,
        method,
        path,
        &[("Authorization", auth.as_str())],
        body,
    )
    .expect("request to the gateway")
}

struct Gateway {
    child: Child,
    addr: SocketAddr,
}

impl Gateway {
    /// A gateway in `dir` routing the bench's model to `upstream`, with
    /// `extra` appended to its config.
    fn start(dir: &Path, upstream: SocketAddr, pki: Option<&Pki>, extra: &str) -> Gateway {
        std::fs::create_dir_all(dir).expect("gateway dir");
        let port = common::free_port();
        let target = match pki {
            None => format!("base_url = \"http://{upstream}/v1\"\n"),
            Some(p) => format!(
                "base_url = \"https://localhost:{}/v1\"\nca_file = \"{}\"\n",
                upstream.port(),
                p.ca.display()
            ),
        };
        let hash: String = {
            use sha2::Digest;
            sha2::Sha256::digest(KEY.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        let config = dir.join("gateway.toml");
        std::fs::write(
            &config,
            format!(
                "[[keys]]\nid = \"bench\"\ntenant = \"bench\"\nscopes = [\"infer\"]\nsha256 = \"{hash}\"\n\
                 [[upstreams]]\nname = \"up\"\n{target}models = [\"bench-model\"]\n{extra}"
            ),
        )
        .expect("write config");
        // `PROXY_THROUGHPUT_GATEWAY`: another `mlxgate` binary (an A/B of
        // two builds against the same nginx).
        let bin = std::env::var_os("PROXY_THROUGHPUT_GATEWAY").map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_mlxgate")),
            PathBuf::from,
        );
        let model = dir.join("no-model.gguf");
        let child = common::spawn_gateway(&bin, &config, port, &dir.join("data"), &model, ADMIN);
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        common::wait_listening(addr, "mlxgate");
        // Both routers send the bench's tenant/model to upstream `up`.
        let tenants = "%7B%22tenants%22%3A%7B%22bench%22%3A%7B%22upstream%22%3A%22up%22%7D%7D%7D";
        for (name, crate_name, config) in [
            (REUSED, "tenant_router", tenants),
            (CALLED, "least_loaded", ""),
        ] {
            let wasm = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!(
                "../policies/target/wasm32-unknown-unknown/release/{crate_name}.wasm"
            ));
            let bytes = std::fs::read(&wasm).unwrap_or_else(|e| {
                panic!(
                    "{} missing ({e}): run scripts/build-policies.sh",
                    wasm.display()
                )
            });
            let (status, body) = request(
                addr,
                "PUT",
                // 50 ms, not the default 5 ms: saturating 2 cores stalls
                // threads for milliseconds, and the deadline is wall-clock.
                &format!(
                    "/admin/policies/{name}?kind=router&on_error=fail_closed&deadline_ms=50&config={config}"
                ),
                &bytes,
            );
            assert!(status == 200 || status == 201, "upload: {status} {body}");
        }
        Gateway { child, addr }
    }

    /// Binds the router policy `name`, or unbinds the router (`None`).
    fn bind(&self, name: Option<&str>) {
        let body = serde_json::json!({ "policy": name }).to_string();
        let (status, text) = request(self.addr, "PUT", "/admin/bindings/router", body.as_bytes());
        assert_eq!(status, 200, "bind: {text}");
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nginx's error log, for the bench's error message.
static NGINX_LOG: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// nginx as our own foreground process with a generated config.
struct Nginx {
    child: Child,
    addr: SocketAddr,
}

impl Nginx {
    fn start(bin: &Path, dir: &Path, upstream: SocketAddr, pki: Option<&Pki>) -> Nginx {
        let port = common::free_port();
        // Over TLS: verified against the CA, the session reused, as the
        // gateway does.
        let (scheme, tls) = match pki {
            None => ("http", String::new()),
            Some(p) => (
                "https",
                format!(
                    " proxy_ssl_verify on; proxy_ssl_trusted_certificate {}; proxy_ssl_name localhost; \
                     proxy_ssl_server_name on; proxy_ssl_session_reuse on;",
                    p.ca.display()
                ),
            ),
        };
        let root = dir.join("nginx");
        std::fs::create_dir_all(&root).expect("nginx dir");
        let conf = root.join("nginx.conf");
        let _ = NGINX_LOG.set(root.join("error.log"));
        let r = root.display();
        std::fs::write(
            &conf,
            format!(
                "daemon off;\nworker_processes auto;\npid {r}/nginx.pid;\nerror_log {r}/error.log warn;\n\
                 events {{ worker_connections 1024; }}\n\
                 http {{\n  access_log off;\n\
                   client_body_temp_path {r}/body;\n  proxy_temp_path {r}/proxy;\n\
                   fastcgi_temp_path {r}/fastcgi;\n  uwsgi_temp_path {r}/uwsgi;\n  scgi_temp_path {r}/scgi;\n\
                   upstream up {{ server {upstream}; keepalive 64; }}\n\
                   server {{\n    listen 127.0.0.1:{port};\n\
                     location / {{ proxy_pass {scheme}://up; proxy_http_version 1.1; proxy_set_header Connection \"\";{tls} }}\n  }}\n}}\n"
            ),
        )
        .expect("write nginx.conf");
        let child = Command::new(bin)
            .arg("-p")
            .arg(&root)
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nginx");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        common::wait_listening(addr, "nginx");
        Nginx { child, addr }
    }

    /// The master and its workers.
    fn pids(&self) -> Vec<u32> {
        let mut p = children(self.child.id());
        p.push(self.child.id());
        p
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM to the master, which stops its workers (a SIGKILL would not).
        let _ = Command::new("sh")
            .args(["-c", &format!("kill -TERM {}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}
