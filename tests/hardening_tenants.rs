//! Tenant isolation over real HTTP against the real binary: prompt-cache
//! prefixes (memory and automatic files) are reused only within a tenant, so
//! `cached_tokens` says nothing about other tenants' prompts; named caches
//! belong to the tenant that saved them and have a disk budget; jobs belong
//! to the submitting key's tenant.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Response, Server, ServerBuilder, real_model};

const ADMIN: &str = "tenants-admin-key";
/// Tenant `a`, two keys.
const A: &str = "tenants-a-key";
const A2: &str = "tenants-a-second-key";
/// Tenant `b`.
const B: &str = "tenants-b-key";

/// `[[keys]]` for A, A2 and B with `scopes`; the admin key comes from the
/// environment (tenant `admin`, every scope).
fn keys(scopes: &str) -> String {
    [("a1", "a", A), ("a2", "a", A2), ("b1", "b", B)]
        .iter()
        .map(|(id, tenant, key)| {
            format!(
                "[[keys]]\nid = \"{id}\"\ntenant = \"{tenant}\"\nscopes = {scopes}\nsha256 = \"{}\"\n",
                mlxgate::http::auth::KeyHash::of(key).to_hex()
            )
        })
        .collect()
}

fn server(config: &str, with_model: bool) -> Server {
    let mut b = ServerBuilder::new()
        .config(config)
        .env("MLXGATE_ADMIN_KEY", ADMIN);
    if with_model {
        b = b.model(real_model());
    }
    let s = b.start();
    if with_model {
        s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    }
    s
}

fn call(addr: SocketAddr, method: &str, path: &str, key: &str, body: Option<&Value>) -> Response {
    support::keyed_call(addr, method, path, key, body)
}

fn model_id(s: &Server) -> String {
    s.get("/readyz").json()["model"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A shared opening long enough that a reused prefix is obvious, then a
/// question that differs per request.
const OPENING: &str = "You are the assistant of a small bakery in the old town. You answer questions about opening hours, sourdough bread, rye bread, cakes, pastries and prices, always briefly and kindly.";

fn prompt(question: &str) -> String {
    format!("{OPENING}\nQuestion: {question}\nAnswer:")
}

/// `cached_tokens` of a short greedy completion of `text` made with `key`.
fn cached_tokens(s: &Server, model: &str, key: &str, text: &str) -> u64 {
    let body = json!({"model": model, "prompt": text, "max_tokens": 1, "temperature": 0});
    let r = call(s.addr, "POST", "/v1/completions", key, Some(&body));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn prefix_caches_are_reused_within_a_tenant_only() {
    // Both tiers on: the memory LRU and automatic files for prompts of 16+
    // tokens (written in the background after the prefill).
    let config = format!(
        "{}[prompt_cache]\nauto_save_min_tokens = 16\n",
        keys(r#"["infer"]"#)
    );
    let s = server(&config, true);
    let model = model_id(&s);

    assert_eq!(
        cached_tokens(&s, &model, A, &prompt("When do you open?")),
        0
    );
    // Wait for A's automatic file, so that both tiers hold A's prefix.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !s.get("/metrics").text().contains(&format!(
        "mlxgate_prompt_cache_auto_saves_total{{model=\"{model}\"}} 1"
    )) {
        assert!(
            Instant::now() < deadline,
            "no automatic cache file was written"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Tenant B sends the same opening: nothing of A's is reused, so nothing
    // about A's prompt shows.
    assert_eq!(
        cached_tokens(&s, &model, B, &prompt("Do you sell rye bread?")),
        0,
        "tenant b must not reuse tenant a's prefix"
    );
    // Another key of tenant A reuses A's prefix...
    let shared = cached_tokens(&s, &model, A2, &prompt("Is there parking?"));
    assert!(shared > 20, "tenant a reuses its own prefix: {shared}");
    // ...and B reuses what B itself cached.
    let own = cached_tokens(&s, &model, B, &prompt("Do you bake cakes?"));
    assert!(own > 20, "tenant b reuses its own prefix: {own}");
}

#[test]
fn sharing_prefixes_across_tenants_is_an_operator_opt_in() {
    let config = format!(
        "{}[prompt_cache]\nshare_across_tenants = true\n",
        keys(r#"["infer"]"#)
    );
    let s = server(&config, true);
    let model = model_id(&s);
    assert_eq!(
        cached_tokens(&s, &model, A, &prompt("When do you open?")),
        0
    );
    let reused = cached_tokens(&s, &model, B, &prompt("Do you sell rye bread?"));
    assert!(reused > 20, "shared on purpose: {reused}");
}

fn save(s: &Server, key: &str, name: &str, text: &str) -> Response {
    let body = json!({"name": name, "model": model_id(s), "prompt": text});
    call(s.addr, "POST", "/v1/prompt_caches", key, Some(&body))
}

fn listed(s: &Server, key: &str) -> Vec<String> {
    let r = call(s.addr, "GET", "/v1/prompt_caches", key, None);
    assert_eq!(r.status, 200, "{}", r.text());
    let mut names: Vec<String> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn named_caches_belong_to_their_tenant_and_have_a_disk_budget() {
    // 1 MiB per tenant: one short prompt's cache fits, not two.
    let config = format!(
        "{}[prompt_cache]\nmemory_mb = 0\nnamed_disk_mb = 1\n",
        keys(r#"["infer"]"#)
    );
    let s = server(&config, true);
    let model = model_id(&s);
    let short = "Bakery hours:";

    let saved = save(&s, A, "a-cache", short);
    assert_eq!(saved.status, 201, "{}", saved.text());
    let saved = saved.json();
    let tokens = saved["tokens"].as_u64().unwrap();
    assert_eq!(save(&s, B, "b-cache", short).status, 201);

    // Listing: one's own; admins see all.
    assert_eq!(listed(&s, A), ["a-cache"]);
    assert_eq!(listed(&s, A2), ["a-cache"]);
    assert_eq!(listed(&s, B), ["b-cache"]);
    assert_eq!(listed(&s, ADMIN), ["a-cache", "b-cache"]);
    assert_eq!(saved["owner"], "a");

    // For B, A's cache does not exist: get, delete and use answer exactly as
    // for a name nobody has.
    let path = "/v1/prompt_caches/a-cache";
    let missing = call(s.addr, "GET", "/v1/prompt_caches/nope", B, None).api_error(
        404,
        "not_found_error",
        "prompt_cache_not_found",
    );
    let e = call(s.addr, "GET", path, B, None).api_error(
        404,
        "not_found_error",
        "prompt_cache_not_found",
    );
    assert_eq!(
        e["message"].as_str().unwrap().replace("a-cache", "nope"),
        missing["message"].as_str().unwrap()
    );
    call(s.addr, "DELETE", path, B, None).api_error(
        404,
        "not_found_error",
        "prompt_cache_not_found",
    );
    let use_it = json!({"model": model, "prompt": format!("{short} 9 to 5"), "max_tokens": 1, "prompt_cache": "a-cache"});
    let e = call(s.addr, "POST", "/v1/completions", B, Some(&use_it)).api_error(
        400,
        "invalid_request_error",
        "prompt_cache_not_found",
    );
    assert_eq!(e["param"], "prompt_cache");
    // B cannot save over it either (in any case).
    for name in ["a-cache", "A-Cache"] {
        let e = save(&s, B, name, "Something else entirely, and longer").api_error(
            409,
            "conflict_error",
            "prompt_cache_name_taken",
        );
        assert!(
            e["message"].as_str().unwrap().contains("another name"),
            "{e}"
        );
    }
    // A's cache is intact and usable by A and by admins.
    let r = call(s.addr, "GET", path, A2, None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["tokens"], tokens);
    for key in [A, ADMIN] {
        let r = call(s.addr, "POST", "/v1/completions", key, Some(&use_it));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    }

    // Reserved names are refused.
    for name in ["auto-x", "AUTO-0123456789abcdef"] {
        let e = save(&s, A, name, short).api_error(400, "invalid_request_error", "invalid_value");
        assert_eq!(e["param"], "name");
        assert!(e["message"].as_str().unwrap().contains("reserved"), "{e}");
    }

    // The budget: a second cache does not fit next to A's first; the error
    // says what to delete. Nothing is written.
    let long = prompt("What does a loaf of sourdough cost, and do you slice it?");
    let e = save(&s, A, "a-long", &long).api_error(
        400,
        "invalid_request_error",
        "prompt_cache_budget_exceeded",
    );
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("named_disk_mb") && message.contains("a-cache"),
        "{message}"
    );
    assert_eq!(listed(&s, A), ["a-cache"]);
    // Replacing one's own cache is not counted twice; B's budget is its own.
    assert_eq!(save(&s, A, "a-cache", short).status, 201);
    // Once A deletes, it fits again; admins may delete anyone's.
    let r = call(s.addr, "DELETE", path, A2, None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(save(&s, A, "a-second", short).status, 201);
    let r = call(s.addr, "DELETE", "/v1/prompt_caches/b-cache", ADMIN, None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(listed(&s, ADMIN), ["a-second"]);
}

fn submit(s: &Server, key: &str) -> String {
    let body = json!({"kind": "noop", "config": {"steps": 1000, "delay_ms": 50}});
    let r = call(s.addr, "POST", "/api/jobs", key, Some(&body));
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["id"].as_str().unwrap().to_owned()
}

fn job_ids(s: &Server, key: &str) -> Vec<String> {
    let r = call(s.addr, "GET", "/api/jobs?limit=50", key, None);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn jobs_belong_to_the_submitting_tenant() {
    let s = server(&keys(r#"["jobs"]"#), false);
    let admins = submit(&s, ADMIN);
    let as_job = submit(&s, A);
    // Another tenant's key: every route answers as for a job that does not exist.
    let missing = call(s.addr, "GET", "/api/jobs/job-000000009999", B, None).api_error(
        404,
        "not_found_error",
        "job_not_found",
    );
    for id in [&admins, &as_job] {
        for (method, path) in [
            ("GET", format!("/api/jobs/{id}")),
            ("GET", format!("/api/jobs/{id}/events")),
            ("DELETE", format!("/api/jobs/{id}")),
        ] {
            let e = call(s.addr, method, &path, B, None).api_error(
                404,
                "not_found_error",
                "job_not_found",
            );
            assert_eq!(
                e["message"]
                    .as_str()
                    .unwrap()
                    .replace(id.as_str(), "job-000000009999"),
                missing["message"].as_str().unwrap()
            );
        }
    }
    let row = call(s.addr, "GET", &format!("/api/jobs/{as_job}"), A, None).json();
    assert_eq!(
        (row["tenant"].as_str(), row["submitted_by"].as_str()),
        (Some("a"), Some("a1"))
    );
    // Tenant A cannot read or cancel the admin's job either.
    call(s.addr, "GET", &format!("/api/jobs/{admins}"), A2, None).api_error(
        404,
        "not_found_error",
        "job_not_found",
    );
    call(s.addr, "DELETE", &format!("/api/jobs/{admins}"), A, None).api_error(
        404,
        "not_found_error",
        "job_not_found",
    );

    // Listing: one's tenant's jobs; admins see all.
    assert!(job_ids(&s, B).is_empty());
    assert_eq!(job_ids(&s, A2), vec![as_job.as_str()]);
    assert_eq!(job_ids(&s, ADMIN), vec![as_job.as_str(), admins.as_str()]);
    let r = call(s.addr, "GET", "/api/jobs?status=running&kind=noop", B, None);
    assert_eq!(r.json()["data"], json!([]), "filters do not widen the view");

    // Both jobs are still running; their owners (or an admin) stop them.
    let r = call(s.addr, "GET", &format!("/api/jobs/{as_job}"), ADMIN, None);
    assert_eq!(r.status, 200, "{}", r.text());
    for (id, key) in [(&as_job, A2), (&admins, ADMIN)] {
        let r = call(s.addr, "DELETE", &format!("/api/jobs/{id}"), key, None);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["status"], "cancelled");
    }
}
