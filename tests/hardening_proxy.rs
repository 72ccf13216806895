//! Hardening of the proxy, `/metrics` and the adapter listings, against the
//! real binary over HTTP: the proxy forwards a normalized path without the
//! client's query, only allow-listed client headers and the gateway's own
//! request id; a 502 names the upstream, never its address; `/metrics`
//! needs a token or an admin key unless scraped from loopback; adapter
//! listings show inference keys store-relative paths only.

#[path = "routing_common/mod.rs"]
mod routing;
#[path = "support/mod.rs"]
mod support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use mlxgate::fixtures::{
    Architecture, LoraSpec, TinyModelSpec, write_random_lora, write_tiny_model,
};
use routing::{FakeUpstream, key_hash};
use serde_json::{Value, json};
use support::{Response, Server, ServerBuilder, free_port, try_request};

const ADMIN: &str = "hardening-admin-key";
const APP: &str = "hardening-app-key";

/// `[[keys]]` entry for [`APP`], an inference-only key.
fn app_key() -> String {
    format!(
        "[[keys]]\nid = \"app\"\ntenant = \"acme\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
        key_hash(APP)
    )
}

fn chat(s: &Server, path: &str, model: &str, extra: &[(&str, &str)]) -> Response {
    let auth = format!("Bearer {APP}");
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    headers.extend_from_slice(extra);
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    s.request("POST", path, &headers, Some(body.to_string().as_bytes()))
}

/// What the fake upstream saw, after checking the request was proxied.
fn seen(r: &Response) -> Value {
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mlxgate-upstream"), Some("up"), "{}", r.text());
    r.json()
}

#[test]
fn proxied_requests_carry_a_normalized_path_no_query_and_allowed_headers_only() {
    let up = FakeUpstream::start();
    // `messy` is the same fake behind a base URL with doubled slashes.
    let config = format!(
        "{}[[upstreams]]\nname = \"up\"\nbase_url = \"{}\"\napi_key = \"sk-upstream\"\nmodels = [\"m\"]\n\
         [[upstreams]]\nname = \"messy\"\nbase_url = \"http://{}//v1//\"\nmodels = [\"messy-model\"]\n",
        app_key(),
        up.base_url(),
        up.addr
    );
    let s = ServerBuilder::new().config(&config).start();

    // The client's query string stays here.
    let v = seen(&chat(
        &s,
        "/v1/chat/completions?x=1&api-version=evil",
        "m",
        &[],
    ));
    assert_eq!(v["path"], "/v1/chat/completions", "{v}");
    assert_eq!(v["query"], Value::Null, "{v}");

    // A `//` prefix reaches the upstream as the routed path, joined once.
    for path in ["//v1/chat/completions", "//v1/chat/completions?y=2"] {
        let v = seen(&chat(&s, path, "m", &[]));
        assert_eq!(
            (v["path"].as_str(), v["query"].as_str()),
            (Some("/v1/chat/completions"), None),
            "{path}: {v}"
        );
    }
    let r = chat(&s, "/v1/completions", "messy-model", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["path"], "/v1/completions", "{}", r.text());

    // Only allow-listed client headers go upstream, with the upstream's key.
    let v = seen(&chat(
        &s,
        "/v1/chat/completions",
        "m",
        &[
            ("user-agent", "hardening-test/1"),
            ("accept", "application/json"),
            ("cookie", "session=secret"),
            ("x-forwarded-for", "10.9.8.7"),
            ("openai-organization", "org-client"),
            ("x-tenant", "acme"),
        ],
    ));
    assert_eq!(v["authorization"], "Bearer sk-upstream", "{v}");
    let names: Vec<&str> = v["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    let allowed = [
        "accept",
        "authorization",
        "content-length",
        "content-type",
        "host",
        "openai-beta",
        "user-agent",
        "x-request-id",
    ];
    assert!(
        names.iter().all(|n| allowed.contains(n)),
        "forwarded: {names:?}"
    );
    assert!(names.contains(&"user-agent"), "{names:?}");

    // A client request id with odd characters is replaced by the gateway's
    // own, which is what the upstream gets; a plain one is adopted by the
    // gateway (logged, echoed) and so forwarded, for end-to-end tracing.
    let r = chat(
        &s,
        "/v1/chat/completions",
        "m",
        &[("x-request-id", "evil id<script>;x")],
    );
    let v = seen(&r);
    let gateway_id = r.header("x-request-id").unwrap();
    assert_ne!(gateway_id, "evil id<script>;x");
    assert_eq!(v["x_request_id"].as_str(), Some(gateway_id), "{v}");
    let r = chat(
        &s,
        "/v1/chat/completions",
        "m",
        &[("x-request-id", "trace-42.a:b_c")],
    );
    assert_eq!(r.header("x-request-id"), Some("trace-42.a:b_c"));
    assert_eq!(seen(&r)["x_request_id"], "trace-42.a:b_c");
}

#[test]
fn an_unreachable_upstream_is_a_502_naming_it_but_not_its_address() {
    let port = free_port();
    let config = format!(
        "{}[[upstreams]]\nname = \"down\"\nbase_url = \"http://127.0.0.1:{port}/v1\"\nmodels = [\"m\"]\n",
        app_key()
    );
    let s = ServerBuilder::new().config(&config).start();
    let r = chat(&s, "/v1/chat/completions", "m", &[]);
    let e = r.api_error(502, "server_error", "upstream_unavailable");
    let body = r.text();
    assert!(!body.contains(&format!(":{port}")), "{body}");
    assert!(!body.contains("127.0.0.1"), "{body}");
    assert!(
        e["message"].as_str().unwrap().contains("`down`"),
        "names the upstream: {e}"
    );
    // The cause, address included, is in the server log.
    let log = s.log_text();
    assert!(log.contains(&format!("127.0.0.1:{port}")), "{log}");
}

/// A non-loopback IPv4 address of this machine (`hostname -I`), if any.
fn non_loopback_ip() -> Option<IpAddr> {
    let out = std::process::Command::new("hostname")
        .arg("-I")
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .find(|ip| ip.is_ipv4() && !ip.is_loopback() && !ip.is_unspecified())
}

fn get(addr: SocketAddr, path: &str, key: Option<&str>) -> Response {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    try_request(addr, "GET", path, &headers, None).expect("request")
}

#[test]
fn metrics_without_a_token_answer_loopback_only() {
    let s = ServerBuilder::new()
        .arg("--host")
        .arg("0.0.0.0")
        .config(&app_key())
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    assert_eq!(get(s.addr, "/metrics", None).status, 200);
    match non_loopback_ip() {
        Some(ip) => {
            let remote = SocketAddr::new(ip, s.addr.port());
            let e = get(remote, "/metrics", None).api_error(
                403,
                "permission_error",
                "metrics_forbidden",
            );
            assert!(
                e["message"].as_str().unwrap().contains("token_sha256"),
                "says how to configure a token: {e}"
            );
            get(remote, "/metrics", Some(APP)).api_error(
                403,
                "permission_error",
                "insufficient_scope",
            );
            assert_eq!(get(remote, "/metrics", Some(ADMIN)).status, 200);
            // Other public routes are not affected.
            assert_eq!(get(remote, "/healthz", None).status, 200);
        }
        None => eprintln!("no non-loopback address here; the loopback rule is covered below"),
    }

    // `open_on_loopback = false` closes loopback too (sidecars).
    let s = ServerBuilder::new()
        .config(&format!(
            "{}[metrics]\nopen_on_loopback = false\n",
            app_key()
        ))
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    get(s.addr, "/metrics", None).api_error(403, "permission_error", "metrics_forbidden");
    assert_eq!(get(s.addr, "/metrics", Some(ADMIN)).status, 200);
}

#[test]
fn metrics_with_a_token_need_it_or_an_admin_key() {
    let config = format!(
        "{}[metrics]\ntoken_sha256 = \"{}\"\n",
        app_key(),
        key_hash("scrape-token")
    );
    let s = ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    let r = get(s.addr, "/metrics", None);
    r.api_error(401, "invalid_request_error", "invalid_api_key");
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    get(s.addr, "/metrics", Some("wrong")).api_error(
        401,
        "invalid_request_error",
        "invalid_api_key",
    );
    get(s.addr, "/metrics", Some(APP)).api_error(403, "permission_error", "insufficient_scope");
    let r = get(s.addr, "/metrics", Some("scrape-token"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("mlxgate_http_requests_total"));
    assert_eq!(get(s.addr, "/metrics", Some(ADMIN)).status, 200);
}

#[test]
fn adapter_listings_show_inference_keys_no_absolute_path() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("fixture");
    let spec = TinyModelSpec::new(Architecture::Llama);
    write_tiny_model(&model, &spec).unwrap();
    let store = root.path().join("store");
    for name in ["x", "y"] {
        write_random_lora(&store.join(name), &LoraSpec::for_model(&spec)).unwrap();
    }
    let config = format!(
        "{}[adapters]\nstores = [\"{}\"]\n\n[[adapters.mount]]\nid = \"x\"\npath = \"x\"\n",
        app_key(),
        store.display()
    );
    let s = ServerBuilder::new()
        .model(&model)
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(60));
    let list = |path: &str, key: &str| {
        let r = s.get_with(path, &[("authorization", &format!("Bearer {key}"))]);
        assert_eq!(r.status, 200, "{}", r.text());
        r
    };
    // What the store's absolute path could show up as (tempdir, symlinks).
    let absolute = [
        root.path().display().to_string(),
        root.path().canonicalize().unwrap().display().to_string(),
    ];

    for path in ["/v1/adapters", "/v1/adapters/available"] {
        let r = list(path, APP);
        let text = r.text();
        for a in &absolute {
            assert!(!text.contains(a.as_str()), "{path} leaks {a}: {text}");
        }
        for a in r.json()["data"].as_array().unwrap() {
            assert_eq!(a["path"], a["id"], "store-relative: {a}");
            assert_eq!(a["store"], 0, "{a}");
        }
    }
    let mounted = list("/v1/adapters", APP).json();
    assert_eq!(mounted["data"][0]["id"], "x", "{mounted}");
    let available = list("/v1/adapters/available", APP).json();
    assert_eq!(
        available["data"].as_array().unwrap().len(),
        2,
        "{available}"
    );

    // Operators still see where an adapter lives.
    let admin = list("/v1/adapters", ADMIN).json();
    let p = admin["data"][0]["path"].as_str().unwrap();
    assert!(
        p.starts_with('/') && p.ends_with("/store/x"),
        "admin sees the absolute path: {admin}"
    );
}
