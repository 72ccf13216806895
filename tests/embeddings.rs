//! `POST /v1/embeddings` over HTTP against the real all-MiniLM-L6-v2
//! (installed by `scripts/setup.sh`) next to the chat model: vectors that
//! match sentence-transformers' (reference vectors in
//! `tests/data/minilm_reference.json`), batching that changes no vector,
//! every input shape, base64, usage, and a clear 400 for each bad input;
//! then a chat model that embeds by last-token pooling when enabled, and
//! the official `openai` Python SDK.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use support::{Server, ServerBuilder, real_model, run_sdk_script, workspace_root};

const ENCODER: &str = "all-MiniLM-L6-v2";

fn encoder_dir() -> PathBuf {
    let dir = workspace_root().join("models/all_minilm_l6_v2");
    assert!(
        dir.join("model.safetensors").is_file(),
        "{} is missing: run scripts/setup.sh to install the embedding model",
        dir.display()
    );
    dir
}

/// The chat model plus the encoder, both ready.
fn server_with_encoder() -> Server {
    start(ServerBuilder::new().model(real_model()))
}

fn start(builder: ServerBuilder) -> Server {
    let config = format!(
        "[[models]]\npath = {:?}\nid = \"{ENCODER}\"\n",
        encoder_dir()
    );
    let s = builder.config(&config).start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    s
}

/// The reference texts' vectors against sentence-transformers'; returns the
/// reference and ours.
fn assert_matches_reference(s: &Server) -> (Value, Vec<Vec<f32>>) {
    let path = workspace_root().join("tests/data/minilm_reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let answer = embed(s, json!({"model": ENCODER, "input": reference["texts"]}));
    let ours = vectors(&answer);
    for (i, expected) in reference["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let similarity = cosine(&ours[i], &floats(expected));
        assert!(
            similarity >= 0.9999,
            "text {i}: cosine {similarity} to sentence-transformers"
        );
        assert!(
            (cosine(&ours[i], &ours[i]) - 1.0).abs() < 1e-6,
            "unit length"
        );
    }
    assert_eq!(answer["model"], ENCODER);
    assert_eq!(
        answer["usage"]["prompt_tokens"],
        answer["usage"]["total_tokens"]
    );
    (reference, ours)
}

fn embed(s: &Server, body: Value) -> Value {
    let r = s.post_json("/v1/embeddings", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn vectors(answer: &Value) -> Vec<Vec<f32>> {
    answer["data"]
        .as_array()
        .expect("data")
        .iter()
        .enumerate()
        .map(|(i, item)| {
            assert_eq!(item["index"], i, "{item}");
            assert_eq!(item["object"], "embedding");
            floats(&item["embedding"])
        })
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array of floats")
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn encoder_matches_sentence_transformers_and_batching_changes_no_vector() {
    let s = server_with_encoder();
    let models = s.get("/v1/models").json();
    let listed = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == ENCODER)
        .cloned()
        .expect("the encoder is listed");
    assert_eq!(listed["capabilities"], json!(["embeddings"]));
    assert_eq!(listed["dimensions"], 384);

    let (reference, ours) = assert_matches_reference(&s);
    // Meaning shows: the two sentences about eating are the closest pair.
    assert!(cosine(&ours[0], &ours[1]) > cosine(&ours[0], &ours[2]) + 0.3);

    // One string: [CLS] hello world [SEP] is 4 tokens; its token ids embed
    // as the text does; base64 carries the same floats.
    let text = embed(&s, json!({"model": ENCODER, "input": "hello world"}));
    assert_eq!(text["usage"]["prompt_tokens"], 4);
    let ids = embed(
        &s,
        json!({"model": ENCODER, "input": reference["hello_world_ids"]}),
    );
    assert_eq!(vectors(&text), vectors(&ids));
    let encoded = embed(
        &s,
        json!({"model": ENCODER, "input": "hello world", "encoding_format": "base64"}),
    );
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, vectors(&text)[0]);
    let same_size = embed(
        &s,
        json!({"model": ENCODER, "input": "hello world", "dimensions": 384}),
    );
    assert_eq!(vectors(&same_size), vectors(&text));

    // 64 inputs of mixed lengths in one request, and the same inputs sent
    // by 8 clients at once: each vector as when embedded alone.
    let inputs: Vec<String> = (0..64)
        .map(|i| {
            format!(
                "input {i}: {}",
                "words of varying length ".repeat(i % 9 + 1)
            )
        })
        .collect();
    let batch = vectors(&embed(&s, json!({"model": ENCODER, "input": inputs})));
    let alone: Vec<Vec<f32>> = inputs[..8]
        .iter()
        .map(|t| vectors(&embed(&s, json!({"model": ENCODER, "input": t})))[0].clone())
        .collect();
    let server = &s;
    let concurrent: Vec<Vec<Vec<f32>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = inputs
            .chunks(8)
            .map(|chunk| {
                scope.spawn(move || {
                    vectors(&embed(server, json!({"model": ENCODER, "input": chunk})))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, v) in alone.iter().enumerate() {
        assert!(cosine(v, &batch[i]) > 0.99999, "input {i} in a batch of 64");
    }
    for (i, v) in concurrent.concat().iter().enumerate() {
        assert!(
            cosine(v, &batch[i]) > 0.99999,
            "input {i} sent concurrently"
        );
    }
}

/// Without mlxgate's kernels (other CPUs, GPUs): MLX's matmul, attention
/// and GELU give the same vectors.
#[test]
fn mlx_ops_alone_match_sentence_transformers_too() {
    let s = start(
        ServerBuilder::new()
            .model(real_model())
            .env("MLXGATE_KERNELS", "mlx"),
    );
    assert_matches_reference(&s);
}

#[test]
fn bad_embedding_requests_get_a_clear_400() {
    let s = server_with_encoder();
    let chat_model = s.get("/readyz").json()["model"]
        .as_str()
        .unwrap()
        .to_owned();
    let refused = |body: Value, param: &str, code: &str| {
        let r = s.post_json("/v1/embeddings", &body);
        let error = r.api_error(400, "invalid_request_error", code);
        assert_eq!(error["param"], param, "{error}");
        error["message"].as_str().unwrap().to_owned()
    };
    let message = refused(
        json!({"model": ENCODER, "input": ""}),
        "input",
        "invalid_value",
    );
    assert!(
        message.contains("input[0]") && message.contains("empty string"),
        "{message}"
    );
    refused(
        json!({"model": ENCODER, "input": ["ok", ""]}),
        "input",
        "invalid_value",
    );
    refused(
        json!({"model": ENCODER, "input": []}),
        "input",
        "empty_array",
    );
    refused(
        json!({"model": ENCODER, "input": [[]]}),
        "input",
        "invalid_value",
    );
    let message = refused(
        json!({"model": ENCODER, "input": [101, 30522]}),
        "input",
        "invalid_value",
    );
    assert!(
        message.contains("30522") && message.contains("vocabulary"),
        "{message}"
    );
    refused(
        json!({"model": ENCODER, "input": "x", "dimensions": 128}),
        "dimensions",
        "unsupported_value",
    );
    refused(
        json!({"model": ENCODER, "input": "x", "encoding_format": "hex"}),
        "encoding_format",
        "invalid_value",
    );

    // Over the model's 256 tokens: refused with what to do, or cut on request.
    let long = "token ".repeat(400);
    let message = refused(
        json!({"model": ENCODER, "input": ["short", long]}),
        "input",
        "invalid_value",
    );
    assert!(
        message.contains("input[1]") && message.contains("256") && message.contains("truncate"),
        "{message}"
    );
    let cut = embed(
        &s,
        json!({"model": ENCODER, "input": ["short", long], "truncate": true}),
    );
    assert_eq!(cut["truncated_inputs"], 1);
    assert_eq!(cut["data"].as_array().unwrap().len(), 2);
    // A request with more text than the serving thread tokenizes inline
    // (64 KiB) is tokenized on a blocking thread, with the same checks.
    let many: Vec<String> = (0..30).map(|i| format!("{i} {long}{long}")).collect();
    let big = embed(
        &s,
        json!({"model": ENCODER, "input": many, "truncate": true}),
    );
    assert_eq!(big["truncated_inputs"], 30);
    assert_eq!(big["usage"]["prompt_tokens"], 30 * 256);
    let mut bad = many.clone();
    bad[20] = String::new();
    let message = refused(
        json!({"model": ENCODER, "input": bad, "truncate": true}),
        "input",
        "invalid_value",
    );
    assert!(message.contains("input[20]"), "{message}");

    // Each kind of model refuses the other's endpoint, saying where to go.
    let message = refused(
        json!({"model": chat_model, "input": "x"}),
        "model",
        "model_not_supported",
    );
    assert!(message.contains("embeddings = true"), "{message}");
    let r = s.post_json(
        "/v1/chat/completions",
        &json!({"model": ENCODER, "messages": [{"role": "user", "content": "hi"}]}),
    );
    let error = r.api_error(400, "invalid_request_error", "model_not_supported");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("/v1/embeddings"),
        "{error}"
    );
    s.post_json("/v1/embeddings", &json!({"model": "nope", "input": "x"}))
        .api_error(404, "not_found_error", "model_not_found");
    // The server is unharmed.
    embed(&s, json!({"model": ENCODER, "input": "still fine"}));
}

#[test]
fn a_chat_model_with_embeddings_enabled_embeds_by_its_last_token() {
    // The same file again, under another id, with embeddings enabled.
    let config = format!(
        "[[models]]\npath = {:?}\nid = \"chat\"\nembeddings = true\n",
        real_model()
    );
    let s = ServerBuilder::new()
        .model(real_model())
        .config(&config)
        .start();
    s.wait_for_status("/readyz", 200, Duration::from_secs(120));
    let listed = s.get("/v1/models/chat").json();
    assert_eq!(
        listed["capabilities"],
        json!(["chat.completions", "completions", "embeddings"])
    );
    assert_eq!(listed["dimensions"], 576);
    let answer = embed(
        &s,
        json!({"model": "chat", "input": ["The cat sat.", "Quarterly revenue grew.", "The cat sat."]}),
    );
    let v = vectors(&answer);
    assert_eq!(v[0].len(), 576);
    assert!((cosine(&v[0], &v[0]) - 1.0).abs() < 1e-6);
    assert_eq!(v[0], v[2], "the same text gives the same vector");
    assert!(cosine(&v[0], &v[1]) < 0.999, "different texts differ");
    // It still chats.
    let r = s.post_json(
        "/v1/chat/completions",
        &json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn official_python_sdk_embeds() {
    let s = server_with_encoder();
    run_sdk_script(&s, "embeddings_sdk.py", "openai", &[ENCODER]);
}
