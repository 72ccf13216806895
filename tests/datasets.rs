//! Dataset pipelines over real files through the real gateway: the same
//! records as JSONL shards, gzip and zstd JSONL, CSV shards and Parquet
//! shards give identical output; a pipeline of a Wasm transform, dedupe
//! and a token-length filter (the default model's tokenizer) with a
//! three-way split, in JSONL and in Parquet, the same on one worker or
//! four; bad inputs (corrupt Parquet, a ragged CSV row, invalid UTF-8, a
//! glob matching nothing) fail naming the file and line and leave nothing
//! under a final name; a preview over a file names each record's line.

#[path = "jobs_common/mod.rs"]
mod common;
#[path = "policy_common/mod.rs"]
mod policy_common;
#[path = "support/mod.rs"]
mod support;

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arrow_array::{RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use common::*;
use parquet::arrow::ArrowWriter;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);

fn upload(addr: std::net::SocketAddr, name: &str, crate_name: &str) {
    put_policy(
        addr,
        name,
        "kind=dataset-transform",
        &policy_common::wasm(crate_name),
    );
}

/// 120 alpaca records, every 10th a repeat of an earlier one's question
/// and answer, one with an empty instruction (an error), one very long.
fn records() -> Vec<[String; 3]> {
    (0..120)
        .map(|i| {
            let q = if i % 10 == 9 { i - 5 } else { i };
            let output = match i {
                70 => "word ".repeat(600),
                _ => format!("answer {q}, with \"quotes\", commas and ünïcode"),
            };
            let instruction = if i == 50 {
                String::new()
            } else {
                format!("task {q}")
            };
            let input = if q % 3 == 0 {
                String::new()
            } else {
                format!("context {q}")
            };
            [instruction, input, output]
        })
        .collect()
}

fn jsonl_line(r: &[String; 3]) -> String {
    json!({"instruction": r[0], "input": r[1], "output": r[2]}).to_string()
}

/// Writes the same records in every format, split into shards.
fn write_inputs(root: &Path) {
    let recs = records();
    let shards: Vec<&[[String; 3]]> = recs.chunks(50).collect();
    let dir = |n: &str| {
        let d = root.join(n);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let (jsonl, gz, zst, csv, pq) = (
        dir("jsonl"),
        dir("gz"),
        dir("zst"),
        dir("csv"),
        dir("parquet"),
    );
    for (i, shard) in shards.iter().enumerate() {
        let text: String = shard.iter().map(|r| jsonl_line(r) + "\n").collect();
        std::fs::write(jsonl.join(format!("part-{i}.jsonl")), &text).unwrap();
        let mut e = flate2::write::GzEncoder::new(
            File::create(gz.join(format!("part-{i}.jsonl.gz"))).unwrap(),
            flate2::Compression::default(),
        );
        e.write_all(text.as_bytes()).unwrap();
        e.finish().unwrap();
        let z = zstd::encode_all(text.as_bytes(), 3).unwrap();
        std::fs::write(zst.join(format!("part-{i}.jsonl.zst")), z).unwrap();
        let mut w = csv::Writer::from_path(csv.join(format!("part-{i}.csv"))).unwrap();
        w.write_record(["instruction", "input", "output"]).unwrap();
        for r in *shard {
            w.write_record(r).unwrap();
        }
        w.flush().unwrap();
        write_parquet(&pq.join(format!("part-{i}.parquet")), shard);
    }
}

/// Alpaca columns; the record without an output has a null there.
fn write_parquet(path: &Path, rows: &[[String; 3]]) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("instruction", DataType::Utf8, false),
        Field::new("input", DataType::Utf8, false),
        Field::new("output", DataType::Utf8, true),
    ]));
    let col = |k: usize| {
        rows.iter()
            .map(|r| Some(r[k].clone()))
            .collect::<StringArray>()
    };
    let out: StringArray = rows
        .iter()
        .map(|r| (!r[2].is_empty()).then(|| r[2].clone()))
        .collect();
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(col(0)), Arc::new(col(1)), Arc::new(out)],
    )
    .unwrap();
    let mut w = ArrowWriter::try_new(File::create(path).unwrap(), schema, None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

fn run(addr: std::net::SocketAddr, config: Value) -> Value {
    let row = submit_ok(addr, "dataset", config);
    wait_final(addr, row["id"].as_str().unwrap(), T)
}

fn model() -> std::path::PathBuf {
    support::real_model()
}

#[test]
fn every_format_gives_the_same_output_and_the_pipeline_steps_run_in_order() {
    let root = tempfile::tempdir().unwrap();
    let models = model().parent().unwrap().to_owned();
    // Jobs may read the default model (its tokenizer) too.
    let section = format!(
        "allowed_paths = [{:?}, {:?}]",
        root.path().display().to_string(),
        models.display().to_string()
    );
    let s = support::ServerBuilder::new()
        .config(&config_toml(&section))
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    upload(s.addr, "alpaca", "alpaca-to-chat");
    write_inputs(root.path());
    let steps = json!([
        {"policy": "alpaca"},
        {"dedupe": ["messages"]},
        {"filter_length": {"model": model().display().to_string(), "max_tokens": 256}},
    ]);
    let mut outputs = Vec::new();
    for (name, input) in [
        ("jsonl", "jsonl"),
        ("gz", "gz/*.jsonl.gz"),
        ("zst", "zst"),
        ("csv", "csv/part-*.csv"),
        ("parquet", "parquet/*.parquet"),
    ] {
        let out = root.path().join(format!("out-{name}"));
        let row = run(
            s.addr,
            json!({"input": root.path().join(input).display().to_string(),
                   "output_dir": out.display().to_string(), "steps": steps,
                   "valid_ratio": 0.1, "test_ratio": 0.1, "seed": 3}),
        );
        assert_eq!(row["status"], "done", "{name}: {row}");
        let sum = &row["summary"];
        assert_eq!(sum["input_files"], 3, "{name}: {sum}");
        assert_eq!(sum["records"], 120, "{name}: {sum}");
        // 12 repeats dropped by dedupe, the long one by the length filter,
        // the one without an output failed by the transform.
        assert_eq!(
            (sum["dropped"].as_u64(), sum["errors"].as_u64()),
            (Some(13), Some(1)),
            "{name}: {sum}"
        );
        assert_eq!(sum["kept"], 106);
        let files: Vec<Vec<u8>> = ["train.jsonl", "valid.jsonl", "test.jsonl"]
            .iter()
            .map(|f| std::fs::read(out.join(f)).unwrap())
            .collect();
        let rejected: Vec<Value> = std::fs::read_to_string(out.join("rejected.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let reasons: Vec<(String, String)> = rejected
            .iter()
            .map(|r| {
                (
                    r["step"].as_str().unwrap().to_owned(),
                    r["outcome"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        outputs.push((name, files, reasons, rejected));
    }
    let (_, first, first_reasons, rejected) = &outputs[0];
    for (name, files, reasons, _) in &outputs[1..] {
        assert!(files == first, "{name} output differs from JSONL's");
        assert_eq!(reasons, first_reasons, "{name}");
    }
    let steps_seen: Vec<&str> = rejected
        .iter()
        .map(|r| r["step"].as_str().unwrap())
        .collect();
    assert_eq!(steps_seen.iter().filter(|s| **s == "dedupe").count(), 12);
    assert_eq!(
        steps_seen.iter().filter(|s| **s == "filter_length").count(),
        1
    );
    assert!(steps_seen.contains(&"policy alpaca"));
    let long = rejected
        .iter()
        .find(|r| r["step"] == "filter_length")
        .unwrap();
    assert!(
        long["reason"]
            .as_str()
            .unwrap()
            .contains("tokens, outside 0..=256"),
        "{long}"
    );
    assert_eq!(
        long["line"], 21,
        "record 70 is line 21 of the second shard: {long}"
    );
    assert!(
        long["file"].as_str().unwrap().ends_with("part-1.jsonl"),
        "{long}"
    );
    let train: Vec<Value> = String::from_utf8(first[0].clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(train[0]["messages"][1]["role"], "assistant");
    // Input order kept: the questions of the train split ascend.
    let q: Vec<u64> = train
        .iter()
        .map(|r| {
            r["messages"][0]["content"].as_str().unwrap()[5..]
                .split('\n')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert!(q.windows(2).all(|w| w[0] < w[1]), "{q:?}");

    // Parquet output holds the same records; one worker or four, the same.
    for workers in [1, 4] {
        let out = root.path().join(format!("out-pq-{workers}"));
        let row = run(
            s.addr,
            json!({"input": root.path().join("jsonl").display().to_string(),
                   "output_dir": out.display().to_string(), "steps": steps,
                   "valid_ratio": 0.1, "test_ratio": 0.1, "seed": 3,
                   "output_format": "parquet", "workers": workers, "batch_size": 7}),
        );
        assert_eq!(row["status"], "done", "{row}");
        let rows = read_parquet(&out.join("train.parquet"));
        assert_eq!(rows, train, "{workers} workers");
        assert!(out.join("valid.parquet").is_file() && out.join("rejected.jsonl").is_file());
    }

    // Shuffled: the same kept records in another order, the same order
    // again for the same seed, and no bucket files left.
    let lines_of = |dir: &Path| -> Vec<String> {
        ["train.jsonl", "valid.jsonl", "test.jsonl"]
            .iter()
            .flat_map(|f| {
                std::fs::read_to_string(dir.join(f))
                    .unwrap()
                    .lines()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let mut shuffled = Vec::new();
    for run_no in 0..2 {
        let out = root.path().join(format!("out-shuffled-{run_no}"));
        let row = run(
            s.addr,
            json!({"input": root.path().join("jsonl").display().to_string(),
                   "output_dir": out.display().to_string(), "steps": steps,
                   "valid_ratio": 0.1, "test_ratio": 0.1, "seed": 3, "shuffle": true}),
        );
        assert_eq!(row["status"], "done", "{row}");
        assert_eq!(row["summary"]["kept"], 106);
        assert!(!out.join(".shuffle").exists());
        shuffled.push(lines_of(&out));
    }
    assert_eq!(shuffled[0], shuffled[1], "same seed, same order");
    let plain = lines_of(&root.path().join("out-jsonl"));
    assert_ne!(shuffled[0], plain, "shuffled");
    let (mut a, mut b) = (shuffled[0].clone(), plain);
    a.sort();
    b.sort();
    assert_eq!(a, b, "the same records");
}

/// Rows of a Parquet file as JSON objects.
fn read_parquet(path: &Path) -> Vec<Value> {
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
        File::open(path).unwrap(),
    )
    .unwrap()
    .build()
    .unwrap();
    let mut out = Vec::new();
    for batch in reader {
        let mut w = arrow_json::LineDelimitedWriter::new(Vec::new());
        w.write(&batch.unwrap()).unwrap();
        w.finish().unwrap();
        for line in String::from_utf8(w.into_inner()).unwrap().lines() {
            out.push(serde_json::from_str(line).unwrap());
        }
    }
    out
}

#[test]
fn bad_inputs_fail_naming_the_file_and_line_and_write_nothing() {
    let root = tempfile::tempdir().unwrap();
    let s = server(root.path(), "");
    upload(s.addr, "alpaca", "alpaca-to-chat");
    let p = root.path();
    let good = jsonl_line(&records()[0]);
    std::fs::write(
        p.join("corrupt.parquet"),
        b"PAR1 this is not parquet at all PAR1",
    )
    .unwrap();
    std::fs::write(
        p.join("ragged.csv"),
        "instruction,input,output\na,b,c\nd,e\nf,g,h\n",
    )
    .unwrap();
    let mut bytes = format!("{good}\n{good}\n").into_bytes();
    bytes.extend_from_slice(b"{\"instruction\": \"bad \xff byte\", \"output\": \"x\"}\n");
    bytes.extend_from_slice(format!("{good}\n").as_bytes());
    std::fs::write(p.join("utf8.jsonl"), &bytes).unwrap();

    let failed = |input: &str, extra: Value| {
        let out = p.join(format!("out-{}", input.replace(['/', '*', '.'], "_")));
        let mut cfg = json!({"input": p.join(input).display().to_string(),
                             "output_dir": out.display().to_string(), "policy": "alpaca"});
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let row = run(s.addr, cfg);
        (row, out)
    };
    for (input, expect) in [
        ("corrupt.parquet", "corrupt.parquet"),
        (
            "ragged.csv",
            "ragged.csv line/row 3: 2 fields where the header has 3",
        ),
        ("utf8.jsonl", "utf8.jsonl line/row 3: not valid UTF-8"),
    ] {
        let (row, out) = failed(input, json!({}));
        assert_eq!(row["status"], "failed", "{input}: {row}");
        let error = row["error"].as_str().unwrap_or_default();
        assert!(error.contains(expect), "{input}: {error}");
        let left: Vec<String> = std::fs::read_dir(&out)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        assert!(left.is_empty(), "{input} left {left:?}");
    }
    // Told to, the unreadable record goes to the rejected file instead.
    let (row, out) = failed("utf8.jsonl", json!({"bad_records": "reject"}));
    assert_eq!(row["status"], "done", "{row}");
    assert_eq!(row["summary"]["kept"], 3);
    let rejected = std::fs::read_to_string(out.join("rejected.jsonl")).unwrap();
    let r: Value = serde_json::from_str(rejected.trim()).unwrap();
    assert_eq!(
        (r["line"].as_u64(), r["outcome"].as_str()),
        (Some(3), Some("error"))
    );
    assert!(r["reason"].as_str().unwrap().contains("UTF-8"), "{r}");

    // Refused at submit, naming the field.
    for (cfg, param, says) in [
        (
            json!({"input": p.join("none-*.parquet").display().to_string()}),
            "config.input",
            "no .jsonl",
        ),
        (
            json!({"input": p.join("utf8.jsonl").display().to_string(), "output_format": "xml"}),
            "config.output_format",
            "parquet",
        ),
        (
            json!({"input": p.join("utf8.jsonl").display().to_string(), "steps": [{"shuffle": 1}]}),
            "config.steps[0].shuffle",
            "unknown step",
        ),
        (
            json!({"input": p.join("utf8.jsonl").display().to_string(), "valid_ratio": 0.5, "test_ratio": 0.5}),
            "config.test_ratio",
            "below 1",
        ),
    ] {
        let mut cfg = cfg;
        let o = cfg.as_object_mut().unwrap();
        o.insert(
            "output_dir".into(),
            json!(p.join("o").display().to_string()),
        );
        if !o.contains_key("steps") {
            o.insert("policy".into(), json!("alpaca"));
        }
        let r = submit(s.addr, ADMIN, "dataset", cfg);
        let e = r.api_error(400, "invalid_request_error", "invalid_request");
        assert_eq!(e["param"], param, "{e}");
        assert!(e["message"].as_str().unwrap().contains(says), "{e}");
    }

    // A preview over a file on the server: the first records, with their
    // lines, nothing written.
    let r = call(
        s.addr,
        "POST",
        "/api/datasets/preview",
        ADMIN,
        Some(
            &json!({"steps": [{"policy": "alpaca"}, {"dedupe": []}], "input": p.join("utf8.jsonl").display().to_string(), "limit": 3}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["steps"], json!(["policy alpaca", "dedupe"]));
    let outcomes: Vec<(&str, u64)> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["outcome"].as_str().unwrap(), x["line"].as_u64().unwrap()))
        .collect();
    assert_eq!(outcomes, [("keep", 1), ("drop", 2), ("error", 3)], "{v}");
    assert_eq!(v["results"][1]["reason"], "duplicate of an earlier record");
    // The same from the command line.
    let (status, out, err) = support::run_cli(
        &[
            "dataset",
            "preview",
            &p.join("utf8.jsonl").display().to_string(),
            "--steps",
            r#"[{"policy": "alpaca"}, {"dedupe": []}]"#,
            "--limit",
            "3",
            "--url",
            &format!("http://{}", s.addr),
        ],
        &[("MLXGATE_API_KEY", ADMIN)],
    );
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("line 1: keep {\"messages\""), "{out}");
    assert!(
        out.contains("line 2: drop by dedupe: duplicate of an earlier record"),
        "{out}"
    );
    assert!(
        out.contains("line 3: error by reading: not valid UTF-8"),
        "{out}"
    );
    assert!(
        err.contains("1 kept, 1 dropped, 1 failed (nothing written)"),
        "{err}"
    );
    // Reading server files is an admin's right.
    let worker = call(
        s.addr,
        "POST",
        "/api/datasets/preview",
        WORKER,
        Some(&json!({"transform": "alpaca", "input": p.join("utf8.jsonl").display().to_string()})),
    );
    worker.api_error(403, "permission_error", "insufficient_scope");
}

/// Sends `PUT path` with a `Content-Length` of `total` bytes, in `pieces`
/// pieces `gap` apart, and returns the status line's code.
fn slow_put(
    addr: std::net::SocketAddr,
    path: &str,
    pieces: &[&[u8]],
    gap: Duration,
    total: usize,
) -> u16 {
    use std::io::Read;
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(
        c,
        "PUT {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ADMIN}\r\ncontent-length: {total}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    for p in pieces {
        c.write_all(p).unwrap();
        std::thread::sleep(gap);
    }
    let mut answer = String::new();
    let _ = c.read_to_string(&mut answer);
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[test]
fn files_stream_into_the_store_atomically_and_jobs_read_them() {
    let root = tempfile::tempdir().unwrap();
    let store = root.path().join("store");
    // A 1 s body deadline, renewed while an upload makes progress.
    let s = support::ServerBuilder::new()
        .config(&format!(
            "{}[server]\nrequest_timeout_secs = 1\n",
            config_toml(&format!(
                "allowed_paths = [{:?}]\nmax_upload_bytes = 200000",
                store.display().to_string()
            ))
        ))
        .env("MLXGATE_ADMIN_KEY", ADMIN)
        .start();
    upload(s.addr, "alpaca", "alpaca-to-chat");
    let text: String = records()[..40]
        .iter()
        .map(|r| jsonl_line(r) + "\n")
        .collect();
    let put = |name: &str, body: &[u8], key: &str| {
        support::try_request(
            s.addr,
            "PUT",
            &format!("/api/files/{name}"),
            &[("authorization", &auth(key))],
            Some(body),
        )
        .unwrap()
    };
    let r = put("alpaca.jsonl", text.as_bytes(), ADMIN);
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    use sha2::Digest;
    assert_eq!(
        v["sha256"],
        format!("{:x}", sha2::Sha256::digest(text.as_bytes()))
    );
    assert_eq!(v["bytes"], text.len());
    assert_eq!(
        std::fs::read_to_string(store.join("alpaca.jsonl")).unwrap(),
        text
    );
    assert_eq!(
        put("alpaca.jsonl", text.as_bytes(), ADMIN).status,
        200,
        "replaced"
    );
    let list = call(s.addr, "GET", "/api/files", ADMIN, None).json();
    assert_eq!(list["data"][0]["name"], "alpaca.jsonl", "{list}");
    assert_eq!(list["data"].as_array().unwrap().len(), 1, "{list}");

    // A job reads it from the store.
    let row = run(
        s.addr,
        json!({"input": v["path"], "output_dir": store.join("chat").display().to_string(), "policy": "alpaca"}),
    );
    assert_eq!(row["status"], "done", "{row}");
    assert_eq!(row["summary"]["records"], 40);

    // An upload slower than the body deadline passes while it progresses;
    // one that stalls gets 408, and neither leaves a file behind.
    let piece = [b'x'; 100];
    let pieces = [&piece[..]; 6];
    let code = slow_put(
        s.addr,
        "/api/files/slow.bin",
        &pieces,
        Duration::from_millis(400),
        600,
    );
    assert_eq!(code, 201, "a 2.4 s upload with a 1 s stall limit");
    let code = slow_put(
        s.addr,
        "/api/files/stalled.bin",
        &pieces[..1],
        Duration::from_millis(1600),
        600,
    );
    assert_eq!(code, 408);
    assert!(!store.join("stalled.bin").exists());

    // Refusals.
    put("big.bin", &vec![0u8; 200_001], ADMIN).api_error(
        413,
        "invalid_request_error",
        "request_too_large",
    );
    for bad in [".hidden", "a%2Fb", "..", "x%20y"] {
        let r = put(bad, b"x", ADMIN);
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
    put("w.jsonl", b"x", WORKER).api_error(403, "permission_error", "insufficient_scope");
    let left: Vec<String> = std::fs::read_dir(&store)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    let r = call(s.addr, "DELETE", "/api/files/alpaca.jsonl", ADMIN, None);
    assert_eq!(r.status, 200, "{}", r.text());
    call(s.addr, "DELETE", "/api/files/alpaca.jsonl", ADMIN, None).api_error(
        404,
        "not_found_error",
        "file_not_found",
    );
}

#[test]
fn a_job_killed_mid_run_resumes_from_its_checkpoint_with_the_same_output() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let start = || {
        support::ServerBuilder::new()
            .config(&config_toml(&format!(
                "allowed_paths = [{:?}]",
                root.path().display().to_string()
            )))
            .env("MLXGATE_ADMIN_KEY", ADMIN)
            .data_dir(&data)
            .start()
    };
    let mut a = start();
    upload(a.addr, "alpaca", "alpaca-to-chat");
    // Enough records, one per guest call on one worker, to outlast a
    // checkpoint (every 2 s) on this machine.
    let base = records();
    let input = root.path().join("big.jsonl");
    let text: String = (0..200_000)
        .map(|i| jsonl_line(&base[i % base.len()]).replace("task", &format!("t{}", i / 240)) + "\n")
        .collect();
    std::fs::write(&input, text).unwrap();
    let config = |out: &str| {
        json!({"input": input.display().to_string(), "output_dir": root.path().join(out).display().to_string(),
               "steps": [{"policy": "alpaca"}, {"dedupe": ["messages"]}],
               "batch_size": 1, "workers": 1, "valid_ratio": 0.1, "seed": 5})
    };
    let out = root.path().join("out");
    let first = submit_ok(a.addr, "dataset", config("out"));
    let checkpoint = out.join(".checkpoint.json");
    let deadline = std::time::Instant::now() + T;
    while !checkpoint.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint written"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = std::process::Command::new("kill")
        .args(["-9", &a.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    a.wait_exit(Duration::from_secs(10));
    let saved: Value = serde_json::from_slice(&std::fs::read(&checkpoint).unwrap()).unwrap();
    let done_before = saved["tally"]["read"].as_u64().unwrap();
    assert!(done_before > 0 && done_before < 200_000, "{saved}");
    assert!(out.join("train.jsonl.partial").exists());
    assert!(
        !out.join("train.jsonl").exists(),
        "nothing under a final name"
    );

    // The gateway comes back; the job is a zombie; the same config resumes.
    let b = start();
    let row = call(
        b.addr,
        "GET",
        &format!("/api/jobs/{}", first["id"].as_str().unwrap()),
        ADMIN,
        None,
    )
    .json();
    assert_eq!(row["status"], "zombie", "{row}");
    let row = submit_ok(b.addr, "dataset", config("out"));
    let id = row["id"].as_str().unwrap().to_owned();
    let row = wait_final(b.addr, &id, Duration::from_secs(300));
    assert_eq!(row["status"], "done", "{row}");
    assert_eq!(row["summary"]["records"], 200_000);
    let events = call(
        b.addr,
        "GET",
        &format!("/api/jobs/{id}/events"),
        ADMIN,
        None,
    )
    .text();
    assert!(
        events.contains("\"stage\":\"resume\""),
        "the job says it resumed: {}",
        &events[..events.len().min(2000)]
    );
    assert!(!checkpoint.exists(), "the checkpoint is gone once done");

    // Byte for byte what an uninterrupted run writes.
    let whole = run(b.addr, config("whole"));
    assert_eq!(whole["status"], "done", "{whole}");
    assert_eq!(whole["summary"], row["summary"]);
    for f in ["train.jsonl", "valid.jsonl", "rejected.jsonl"] {
        let (x, y) = (
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(root.path().join("whole").join(f)).unwrap(),
        );
        assert!(
            x == y,
            "{f} differs after the resume ({} vs {} bytes)",
            x.len(),
            y.len()
        );
    }
}
