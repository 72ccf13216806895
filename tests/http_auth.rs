//! API keys: /v1 needs a valid bearer key with the `infer` scope once any key
//! is configured, /admin and /api are closed without a key, and scopes are
//! enforced.

mod support;

use support::{Server, ServerBuilder, run_cli};

const ADMIN_KEY: &str = "admin-secret-0123456789";
const INFER_KEY: &str = "infer-secret-abcdef";
const JOBS_KEY: &str = "jobs-secret-xyz";

fn hash(key: &str) -> String {
    let (st, out, err) = run_cli(&["keys", "hash", key], &[]);
    assert!(st.success(), "{err}");
    out.trim().to_owned()
}

fn keyed_server() -> Server {
    let config = format!(
        "test_routes = true\n\
         [[keys]]\nid = \"app\"\ntenant = \"acme\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n\
         [[keys]]\nid = \"batch\"\ntenant = \"acme\"\nscopes = [\"jobs\"]\nsha256 = \"{}\"\n",
        hash(INFER_KEY),
        hash(JOBS_KEY)
    );
    ServerBuilder::new()
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN_KEY)
        .start()
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

#[test]
fn missing_or_wrong_key_is_401_in_openai_shape() {
    let s = keyed_server();
    let r = s.get("/v1/models");
    r.api_error(401, "invalid_request_error", "invalid_api_key");
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    for auth in [
        bearer("wrong"),
        "Basic Zm9vOmJhcg==".into(),
        "Bearer".into(),
        bearer(&hash(INFER_KEY)),
    ] {
        s.get_with("/v1/models", &[("authorization", &auth)])
            .api_error(401, "invalid_request_error", "invalid_api_key");
    }
    // Unknown /v1 routes don't reveal themselves to unauthenticated callers.
    s.get("/v1/does-not-exist")
        .api_error(401, "invalid_request_error", "invalid_api_key");
    // Public endpoints need no key.
    assert_eq!(s.get("/healthz").status, 200);
    assert_eq!(s.get("/metrics").status, 200);
}

#[test]
fn right_key_passes_and_caller_is_in_request_extensions() {
    let s = keyed_server();
    let auth = bearer(INFER_KEY);
    assert_eq!(
        s.get_with("/v1/models", &[("authorization", &auth)]).status,
        200
    );
    let me = s.get_with("/v1/__test/whoami", &[("authorization", &auth)]);
    assert_eq!(me.status, 200, "{}", me.text());
    assert_eq!(
        me.json(),
        serde_json::json!({"key_id": "app", "tenant": "acme", "scopes": ["infer"]})
    );
    let admin = s.get_with(
        "/v1/__test/whoami",
        &[("authorization", &bearer(ADMIN_KEY))],
    );
    assert_eq!(
        admin.json(),
        serde_json::json!({"key_id": "admin", "tenant": "admin", "scopes": ["infer", "jobs", "admin"]})
    );
    // Admin key passes the admin zone (404: no such route yet, but past auth).
    s.get_with("/admin/anything", &[("authorization", &bearer(ADMIN_KEY))])
        .api_error(404, "not_found_error", "unknown_url");
    s.get_with("/api/nope", &[("authorization", &bearer(JOBS_KEY))])
        .api_error(404, "not_found_error", "unknown_url");
}

#[test]
fn key_without_the_scope_is_403() {
    let s = keyed_server();
    let infer = bearer(INFER_KEY);
    let e = s
        .get_with("/admin/policies", &[("authorization", &infer)])
        .api_error(403, "permission_error", "insufficient_scope");
    assert!(
        e["message"].as_str().unwrap_or_default().contains("admin"),
        "{e}"
    );
    s.get_with("/api/jobs", &[("authorization", &infer)])
        .api_error(403, "permission_error", "insufficient_scope");
    s.get_with("/v1/models", &[("authorization", &bearer(JOBS_KEY))])
        .api_error(403, "permission_error", "insufficient_scope");
}

#[test]
fn without_keys_inference_is_open_on_loopback_and_admin_is_closed() {
    let s = ServerBuilder::new().config("test_routes = true\n").start();
    assert_eq!(s.get("/v1/models").status, 200);
    assert_eq!(s.get("/v1/__test/whoami").json()["key_id"], "anonymous");
    for path in ["/admin/policies", "/api/jobs"] {
        let e = s.get(path).api_error(403, "permission_error", "api_closed");
        assert!(
            e["message"]
                .as_str()
                .unwrap_or_default()
                .contains("MLXGATE_ADMIN_KEY"),
            "{e}"
        );
    }
    // Even a made-up key does not open them.
    s.get_with("/admin/policies", &[("authorization", "Bearer guess")])
        .api_error(403, "permission_error", "api_closed");
}

#[test]
fn refuses_to_start_open_on_a_non_loopback_host() {
    let (st, _, err) = run_cli(&["serve", "--host", "0.0.0.0", "--port", "1"], &[]);
    assert!(!st.success());
    assert!(
        err.contains("refusing to serve inference without API keys"),
        "{err}"
    );
    assert!(err.contains("allow_open_inference"), "{err}");
}

#[test]
fn keys_hash_prints_the_sha256_hex() {
    let (st, out, _) = run_cli(&["keys", "hash", "abc"], &[]);
    assert!(st.success());
    assert_eq!(
        out.trim(),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}
