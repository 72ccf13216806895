//! What a policy's language costs: the same dataset transform
//! (alpaca-to-chat) written in Rust, in Python and in JavaScript, run by
//! the policy host.
//! For each: the component's size, the upload (validation and compilation
//! into a fresh host), a cold call (a fresh instance each: instantiate,
//! `init`, one batch), a warm call (a pooled instance), per batch of 32
//! records and per record, and the most linear memory an instance had.
//!
//! Run: `scripts/setup.sh --tests && scripts/build-policies.sh && cargo bench -p mlxgate --bench guest_languages`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use mlxgate::policy::{HostConfig, Limits, PolicyHost, PolicyKind, PolicyOptions};

const WARM_CALLS: usize = 300;
const COLD_CALLS: usize = 10;

fn component(rel: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../policies/target")
        .join(rel);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{} missing ({e}): run scripts/setup.sh --tests and scripts/build-policies.sh",
            path.display()
        )
    })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let records: Vec<String> = (0..32)
        .map(|i| {
            format!(
                r#"{{"instruction": "Summarise item {i} in one line", "input": "{}", "output": "Item {i} is a small, plain example record."}}"#,
                if i % 2 == 0 { "" } else { "some context" }
            )
        })
        .collect();
    println!(
        "| language | component | upload (compile) | cold call | warm call (32 records) | per record | peak memory |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (language, rel) in [
        ("Rust", "wasm32-unknown-unknown/release/alpaca_to_chat.wasm"),
        ("Python", "python/alpaca_to_chat.wasm"),
        ("JavaScript", "js/alpaca_to_chat.wasm"),
    ] {
        let bytes = component(rel);
        let dir = tempfile::tempdir().expect("temp dir");
        let host = PolicyHost::open(HostConfig::new(dir.path())).expect("policy host");
        let upload = |name: &str, warm: u32| {
            let t = Instant::now();
            host.upload(
                name,
                PolicyKind::DatasetTransform,
                &bytes,
                PolicyOptions {
                    limits: Some(Limits {
                        warm_instances: warm,
                        ..PolicyKind::DatasetTransform.default_limits()
                    }),
                    ..PolicyOptions::default()
                },
            )
            .expect("upload");
            t.elapsed()
        };
        let compile = upload("warm", 1);
        // No warm instance: every call makes a fresh one.
        upload("cold", 0);
        let call = |name: &str| {
            let t = Instant::now();
            let out = host.transform_batch(name, &records).expect("call");
            assert_eq!(out.len(), records.len());
            t.elapsed()
        };
        let cold = median((0..COLD_CALLS).map(|_| call("cold")).collect());
        call("warm");
        let warm = median((0..WARM_CALLS).map(|_| call("warm")).collect());
        let metrics = host.metrics();
        let peak = metrics
            .iter()
            .find(|m| m.name == "warm")
            .map_or(0, |m| m.memory_peak_bytes);
        println!(
            "| {language} | {:.2} MB | {:.0} ms | {:.2} ms | {:.0} us | {:.1} us | {:.1} MiB |",
            bytes.len() as f64 / 1e6,
            compile.as_secs_f64() * 1e3,
            cold.as_secs_f64() * 1e3,
            warm.as_secs_f64() * 1e6,
            warm.as_secs_f64() * 1e6 / records.len() as f64,
            peak as f64 / (1 << 20) as f64
        );
    }
    println!(
        "\nmedians of {COLD_CALLS} cold and {WARM_CALLS} warm calls; upload: one, into a fresh host (no cached compilation)"
    );
}
