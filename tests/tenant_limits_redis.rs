//! `[limits] backend = "redis"`: two gateway processes share one real
//! `redis-server` (from apt, started here on a free port) and enforce one
//! combined limit; with Redis killed each follows its `on_redis_error`
//! (`allow` serves, `refuse` answers 503), and both enforce again once
//! Redis is back.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Response, Server, ServerBuilder, free_port, real_model};

/// A `redis-server` on `port` without persistence; killed on drop.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start(port: u16) -> Redis {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: scripts/setup.sh installs it (apt package redis-server)");
        let redis = Redis { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !redis.pong() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        redis
    }

    fn pong(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn secret(id: &str) -> String {
    format!("{id}-secret")
}

fn gateway(redis_port: u16, on_error: &str) -> (Server, String) {
    let keys: String = [("a1", "a"), ("t1", "t")]
        .iter()
        .map(|(id, tenant)| {
            format!(
                "[[keys]]\nid = \"{id}\"\ntenant = \"{tenant}\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
                mlxgate::http::auth::KeyHash::of(&secret(id)).to_hex()
            )
        })
        .collect();
    let config = format!(
        "{keys}\n[limits]\nbackend = \"redis\"\nredis_url = \"redis://127.0.0.1:{redis_port}\"\non_redis_error = \"{on_error}\"\n\
         [limits.tenants.a]\nrequests_per_minute = 4\n[limits.tenants.t]\ntokens_per_minute = 40\n"
    );
    let s = ServerBuilder::new()
        .config(&config)
        .model(real_model())
        .start();
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let model = ready.json()["model"].as_str().unwrap().to_owned();
    (s, model)
}

fn call(addr: SocketAddr, key: &str, body: &Value) -> Response {
    support::keyed_call(addr, "POST", "/v1/completions", &secret(key), Some(body))
}

fn remaining(r: &Response, what: &str) -> Option<u64> {
    r.header(&format!("x-ratelimit-remaining-{what}"))
        .map(|v| v.parse().unwrap())
}

#[test]
fn two_gateways_share_one_limit_through_redis_and_follow_on_redis_error() {
    let port = free_port();
    let redis = Redis::start(port);
    let (allow, model) = gateway(port, "allow");
    let (refuse, _) = gateway(port, "refuse");
    let both = [allow.addr, refuse.addr];
    let cheap = json!({"model": model, "prompt": "Hi", "max_tokens": 1});

    // Four requests a minute for tenant a, taken in turn from both.
    for (i, left) in [3, 2, 1, 0].into_iter().enumerate() {
        let r = call(both[i % 2], "a1", &cheap);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(remaining(&r, "requests"), Some(left));
    }
    for addr in both {
        let r = call(addr, "a1", &cheap);
        r.api_error(429, "requests", "rate_limit_exceeded");
        assert!(r.header("retry-after").is_some());
    }

    // Tokens charged on one gateway count on the other: 15 + 15 + 15 > 40.
    let fifteen = json!({
        "model": model, "prompt": [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000],
        "max_tokens": 5, "temperature": 0, "logit_bias": {"0": -100, "1": -100, "2": -100},
    });
    for i in 0..3 {
        let r = call(both[i % 2], "t1", &fifteen);
        assert_eq!(r.json()["usage"]["total_tokens"], 15, "{}", r.text());
    }
    call(both[1], "t1", &fifteen).api_error(429, "tokens", "rate_limit_exceeded");

    // Redis gone: `allow` serves without limits, `refuse` answers 503.
    drop(redis);
    let r = call(allow.addr, "a1", &cheap);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        remaining(&r, "requests"),
        None,
        "nothing counted, nothing to say"
    );
    let r = call(refuse.addr, "a1", &cheap);
    r.api_error(503, "server_error", "rate_limiter_unavailable");
    assert!(r.header("retry-after").is_some());

    // Redis back (empty): both count again, together.
    let _redis = Redis::start(port);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut first = loop {
        let r = call(allow.addr, "a1", &cheap);
        if remaining(&r, "requests").is_some() {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway did not reconnect to Redis"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(remaining(&first, "requests"), Some(3));
    for left in [2, 1, 0] {
        let deadline = Instant::now() + Duration::from_secs(20);
        first = loop {
            let r = call(refuse.addr, "a1", &cheap);
            if r.status != 503 {
                break r;
            }
            assert!(
                Instant::now() < deadline,
                "the refusing gateway did not reconnect"
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        assert_eq!(first.status, 200, "{}", first.text());
        assert_eq!(remaining(&first, "requests"), Some(left));
    }
    call(allow.addr, "a1", &cheap).api_error(429, "requests", "rate_limit_exceeded");
    for s in [&allow, &refuse] {
        let log = s.log_text();
        assert!(log.contains("Redis unreachable"), "{log}");
        assert!(log.contains("Redis reachable again"), "{log}");
    }
}
