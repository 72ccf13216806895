//! `/v1/adapters` over real HTTP on a tiny model: admin-only mounts kept
//! inside the adapter stores, listing, selection by body field, header and
//! the `adapter-by-tenant` Wasm policy, unknown ids, unmounting.
//! Needs `scripts/build-policies.sh` (the policy guest).

#[path = "policy_common/mod.rs"]
mod common;
#[path = "routing_common/mod.rs"]
mod routing;
#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use mlxgate::fixtures::{
    Architecture, LoraSpec, TinyModelSpec, write_random_lora, write_tiny_model,
};
use mlxgate::http::auth::KeyHash;
use serde_json::{Value, json};
use support::{Response, Server, ServerBuilder};

const ADMIN: &str = "lora-http-admin-key";
const ACME: &str = "lora-http-acme-key";

fn call(
    s: &Server,
    method: &str,
    path: &str,
    key: &str,
    body: Option<Value>,
    extra: &[(&str, &str)],
) -> Response {
    let auth = format!("Bearer {key}");
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    headers.extend_from_slice(extra);
    let bytes = body.map(|b| b.to_string().into_bytes());
    s.request(method, path, &headers, bytes.as_deref())
}

fn chat(s: &Server, key: &str, adapter: Option<&str>, extra: &[(&str, &str)]) -> Response {
    let mut body =
        json!({"model": "fixture", "max_tokens": 8, "temperature": 0, "prompt": "the fox"});
    if let Some(a) = adapter {
        body["adapter"] = json!(a);
    }
    call(s, "POST", "/v1/completions", key, Some(body), extra)
}

fn text(r: Response) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[test]
fn mount_select_and_unmount_adapters_over_http() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("fixture");
    write_tiny_model(&model, &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let store = root.path().join("store");
    for (name, seed) in [("x", 1), ("y", 2), ("z", 3)] {
        let spec = LoraSpec {
            seed,
            ..LoraSpec::for_model(&TinyModelSpec::new(Architecture::Llama))
        };
        write_random_lora(&store.join(name), &spec).unwrap();
    }
    let config = format!(
        "[adapters]\nstores = [\"{}\"]\n\n[[keys]]\nid = \"acme\"\ntenant = \"acme\"\nscopes = [\"infer\"]\nsha256 = \"{}\"\n",
        store.display(),
        KeyHash::of(ACME).to_hex()
    );
    let s = ServerBuilder::new()
        .model(&model)
        .config(&config)
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    s.wait_for_status("/healthz", 200, Duration::from_secs(20));
    let ready = s.wait_for_status("/readyz", 200, Duration::from_secs(60));
    assert_eq!(ready.status, 200);

    // Mounting is admin-only and stays inside the stores.
    let mount = |key: &str, id: &str, path: &str| {
        call(
            &s,
            "POST",
            "/v1/adapters",
            key,
            Some(json!({"id": id, "path": path})),
            &[],
        )
    };
    mount(ACME, "x", "x").api_error(403, "permission_error", "insufficient_scope");
    for outside in ["../fixture", "/tmp", model.to_str().unwrap()] {
        let e =
            mount(ADMIN, "bad", outside).api_error(400, "invalid_request_error", "invalid_value");
        assert_eq!(e["param"], "path", "{e}");
    }
    mount(ADMIN, "a+b", "x").api_error(400, "invalid_request_error", "invalid_value");
    let x = mount(ADMIN, "x", "x");
    assert_eq!(x.status, 201, "{}", x.text());
    assert_eq!(x.json()["modules"], 14);
    assert!(x.json()["mount_ms"].as_f64().unwrap() >= 0.0);
    assert_eq!(
        mount(ADMIN, "y", store.join("y").to_str().unwrap()).status,
        201
    );

    let listed = call(&s, "GET", "/v1/adapters", ACME, None, &[]).json();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["x", "y"]);
    let available = call(&s, "GET", "/v1/adapters/available", ACME, None, &[]).json();
    let found: Vec<(String, bool)> = available["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["id"].as_str().unwrap().to_owned(),
                a["mounted"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        found,
        vec![("x".into(), true), ("y".into(), true), ("z".into(), false)]
    );

    // Selection: body field, header, stacking, unknown ids.
    let base = text(chat(&s, ACME, None, &[]));
    let with_x = text(chat(&s, ACME, Some("x"), &[]));
    assert_ne!(base, with_x, "the adapter should change the output");
    assert_eq!(text(chat(&s, ACME, None, &[("x-adapter", "x")])), with_x);
    assert_eq!(
        text(chat(&s, ACME, Some("none"), &[("x-adapter", "x")])),
        base
    );
    assert_eq!(chat(&s, ACME, Some("x+y"), &[]).status, 200);
    let e = chat(&s, ACME, Some("x,nope"), &[]).api_error(
        400,
        "invalid_request_error",
        "adapter_not_found",
    );
    assert_eq!(e["param"], "adapter");
    assert!(
        e["message"].as_str().unwrap().contains("mounted: x, y"),
        "{e}"
    );

    // The adapter-by-tenant policy picks for requests that name none.
    let path = format!(
        "/admin/policies/by-tenant?kind=adapter-selector&config={}",
        routing::urlencode(r#"{"tenants": {"acme": ["x"]}}"#)
    );
    let auth = format!("Bearer {ADMIN}");
    let r = s.request(
        "PUT",
        &path,
        &[("authorization", &auth)],
        Some(&common::wasm("adapter-by-tenant")),
    );
    assert!(r.status == 200 || r.status == 201, "upload: {}", r.text());
    let bind = json!({"policy": "by-tenant"});
    assert_eq!(
        call(
            &s,
            "PUT",
            "/admin/bindings/adapter-selector",
            ADMIN,
            Some(bind),
            &[]
        )
        .status,
        200
    );
    assert_eq!(
        text(chat(&s, ACME, None, &[])),
        with_x,
        "acme's policy choice"
    );
    assert_eq!(
        text(chat(&s, ADMIN, None, &[])),
        base,
        "no choice for other tenants"
    );
    assert_eq!(
        text(chat(&s, ACME, Some("none"), &[])),
        base,
        "the request's own choice wins"
    );

    // Unmounting: admin only; afterwards the id is unknown.
    call(&s, "DELETE", "/v1/adapters/x", ACME, None, &[]).api_error(
        403,
        "permission_error",
        "insufficient_scope",
    );
    assert_eq!(
        call(&s, "DELETE", "/v1/adapters/x", ADMIN, None, &[]).status,
        200
    );
    call(&s, "DELETE", "/v1/adapters/x", ADMIN, None, &[]).api_error(
        404,
        "not_found_error",
        "adapter_not_found",
    );
    chat(&s, ACME, Some("x"), &[]).api_error(400, "invalid_request_error", "adapter_not_found");
}

#[test]
fn configured_adapters_are_mounted_at_start() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("fixture");
    write_tiny_model(&model, &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let store = root.path().join("store");
    write_random_lora(
        &store.join("x"),
        &LoraSpec::for_model(&TinyModelSpec::new(Architecture::Llama)),
    )
    .unwrap();
    let config = format!(
        "[adapters]\nstores = [\"{}\"]\n\n[[adapters.mount]]\nid = \"x\"\npath = \"x\"\n\n[[adapters.mount]]\nid = \"outside\"\npath = \"/tmp\"\n",
        store.display()
    );
    let s = ServerBuilder::new().model(&model).config(&config).start();
    assert_eq!(
        s.wait_for_status("/readyz", 200, Duration::from_secs(60))
            .status,
        200
    );
    let listed = s.get("/v1/adapters").json();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["x"], "{listed}");
    assert!(
        s.log_text().contains("configured adapter not mounted"),
        "the refused entry is logged"
    );
    assert_eq!(chat(&s, "unused", Some("x"), &[]).status, 200);
}
