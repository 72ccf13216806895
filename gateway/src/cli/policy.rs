//! `mlxgate policy ...` and `mlxgate dataset transform ...`.
//!
//! `policy` commands talk to a running gateway's admin API (`--url`; the key
//! is `MLXGATE_ADMIN_KEY`, else `MLXGATE_API_KEY`: [`super::remote`]), so the
//! server picks changes up at once; with
//! `--data-dir` they work on a data dir directly instead (server stopped).
//! `dataset transform` runs a dataset-transform policy in-process, from the
//! policies stored in a data dir.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use http::Method;
use serde_json::{Value, json};

use super::remote::{Payload, Remote, call_blocking, query_value};
use crate::policy::jsonl::{Batch, JsonlBatches};
use crate::policy::{
    HostConfig, Limits, OnError, PolicyHost, PolicyInfo, PolicyKind, PolicyOptions, RecordOutcome,
};

/// Where `policy` commands act.
#[derive(Args, Debug, Clone)]
pub struct Target {
    #[command(flatten)]
    remote: Remote,
    /// Act on this data dir directly instead of a running gateway (stop the
    /// server first: it would not see the change and could overwrite it).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Upload a policy component (a new version if NAME exists).
    Push(PushArgs),
    /// List policies and bindings.
    List(Target),
    /// Remove a policy (unbind it first).
    Rm {
        name: String,
        #[command(flatten)]
        target: Target,
    },
    /// Make NAME the policy for KIND (router or adapter-selector); `--none`
    /// removes the binding.
    Bind {
        /// router or adapter-selector.
        kind: PolicyKind,
        #[arg(required_unless_present = "none")]
        name: Option<String>,
        #[arg(long, conflicts_with = "name")]
        none: bool,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Args, Debug)]
pub struct PushArgs {
    /// Policy name: 1-64 of [A-Za-z0-9_-].
    name: String,
    /// The component (.wasm) file.
    file: PathBuf,
    /// router, adapter-selector or dataset-transform.
    #[arg(long)]
    kind: PolicyKind,
    /// fail_open (callers use their default) or fail_closed (503).
    #[arg(long, default_value = "fail_open")]
    on_error: OnError,
    /// Configuration string handed to the guest's init.
    #[arg(long, conflicts_with = "config_file")]
    config: Option<String>,
    /// Read the configuration string from a file.
    #[arg(long, value_name = "FILE")]
    config_file: Option<PathBuf>,
    /// Per-call (dataset: per-record) deadline.
    #[arg(long)]
    deadline_ms: Option<u32>,
    /// Per-call (dataset: per-record) fuel; 0 for unmetered.
    #[arg(long)]
    fuel: Option<u64>,
    /// Memory cap in MiB.
    #[arg(long)]
    memory_mb: Option<usize>,
    #[command(flatten)]
    target: Target,
}

#[derive(Subcommand, Debug)]
pub enum DatasetCommand {
    /// Run a dataset-transform policy over a JSONL file: kept records go to
    /// OUTPUT, one per line; progress and a summary go to stderr.
    Transform(TransformArgs),
    /// Ask a running gateway what a pipeline would do to the first records
    /// of an input (POST /api/datasets/preview; nothing is written): each
    /// record's outcome, the step that dropped or failed it, and why.
    Preview(PreviewArgs),
}

#[derive(Args, Debug)]
pub struct PreviewArgs {
    /// The input on the gateway's machine, as a dataset job's `input`: a
    /// file, folder or glob of .jsonl(.gz/.zst), .csv or .parquet under
    /// [jobs] allowed_paths. Needs a key with the jobs and admin scopes.
    input: String,
    /// The steps as JSON, as a dataset job's `steps`, e.g.
    /// '[{"policy": "alpaca"}, {"dedupe": ["messages"]}]'.
    #[arg(long, conflicts_with = "policy", required_unless_present = "policy")]
    steps: Option<String>,
    /// One dataset-transform policy as the only step.
    #[arg(long)]
    policy: Option<String>,
    /// How many records from the start (1-100).
    #[arg(long, default_value_t = 20)]
    limit: usize,
    #[command(flatten)]
    remote: super::remote::Remote,
}

#[derive(Args, Debug)]
pub struct TransformArgs {
    /// Name of a dataset-transform policy stored in the data dir.
    #[arg(long)]
    policy: String,
    /// Input JSONL (one record per line; blank lines are skipped; bytes that
    /// are not UTF-8 reach the policy as U+FFFD).
    input: PathBuf,
    /// Output JSONL.
    output: PathBuf,
    /// Data dir holding the policy.
    #[arg(long, env = "MLXGATE_DATA_DIR", default_value = "data")]
    data_dir: PathBuf,
    /// Records per guest call.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Write dropped and failed records here as JSONL
    /// `{"line", "outcome", "reason"}`.
    #[arg(long, value_name = "FILE")]
    rejects: Option<PathBuf>,
}

fn open_local(dir: &Path) -> anyhow::Result<PolicyHost> {
    let host = PolicyHost::open(HostConfig::new(dir))
        .with_context(|| format!("cannot open the policy store in {}", dir.display()))?;
    for e in host.load_errors() {
        eprintln!("warning: {e}");
    }
    Ok(host)
}

/// Runs a `policy` subcommand.
pub fn run_policy(cmd: PolicyCommand) -> anyhow::Result<()> {
    match cmd {
        PolicyCommand::Push(a) => push(a),
        PolicyCommand::List(t) => {
            let (infos, router, adapter) = match &t.data_dir {
                Some(dir) => {
                    let host = open_local(dir)?;
                    (
                        host.list(),
                        host.binding(PolicyKind::Router),
                        host.binding(PolicyKind::AdapterSelector),
                    )
                }
                None => {
                    let v = admin(&t, Method::GET, "/admin/policies", Payload::None)?;
                    let infos: Vec<PolicyInfo> = serde_json::from_value(v["data"].clone())
                        .context("unexpected answer from the gateway")?;
                    let b = |k: &str| v["bindings"][k].as_str().map(str::to_string);
                    (infos, b("router"), b("adapter-selector"))
                }
            };
            print_list(&infos);
            println!(
                "bindings: router={} adapter-selector={}",
                router.as_deref().unwrap_or("-"),
                adapter.as_deref().unwrap_or("-")
            );
            Ok(())
        }
        PolicyCommand::Rm { name, target } => {
            match &target.data_dir {
                Some(dir) => open_local(dir)?.remove(&name)?,
                None => {
                    admin(
                        &target,
                        Method::DELETE,
                        &format!("/admin/policies/{name}"),
                        Payload::None,
                    )?;
                }
            }
            println!("removed {name}");
            Ok(())
        }
        PolicyCommand::Bind {
            kind, name, target, ..
        } => {
            match &target.data_dir {
                Some(dir) => {
                    let host = open_local(dir)?;
                    match &name {
                        Some(n) => host.bind(kind, n)?,
                        None => host.unbind(kind)?,
                    }
                }
                None => {
                    admin(
                        &target,
                        Method::PUT,
                        &format!("/admin/bindings/{kind}"),
                        Payload::Json(json!({ "policy": name })),
                    )?;
                }
            }
            match name {
                Some(n) => println!("{kind} -> {n}"),
                None => println!("{kind} unbound"),
            }
            Ok(())
        }
    }
}

fn push(a: PushArgs) -> anyhow::Result<()> {
    let bytes =
        std::fs::read(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?;
    let config = match (&a.config, &a.config_file) {
        (Some(c), _) => Some(c.clone()),
        (None, Some(f)) => Some(
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?,
        ),
        (None, None) => None,
    };
    let info: PolicyInfo = match &a.target.data_dir {
        Some(dir) => {
            let d = a.kind.default_limits();
            let custom = a.deadline_ms.is_some() || a.fuel.is_some() || a.memory_mb.is_some();
            let limits = custom.then(|| Limits {
                deadline_ms: a.deadline_ms.unwrap_or(d.deadline_ms),
                fuel: match a.fuel {
                    Some(0) => None,
                    Some(f) => Some(f),
                    None => d.fuel,
                },
                memory_bytes: a.memory_mb.map_or(d.memory_bytes, |m| m << 20),
                ..d
            });
            let opts = PolicyOptions {
                limits,
                on_error: a.on_error,
                config,
            };
            open_local(dir)?.upload(&a.name, a.kind, &bytes, opts)?
        }
        None => {
            let on_error = match a.on_error {
                OnError::FailOpen => "fail_open",
                OnError::FailClosed => "fail_closed",
            };
            let mut q = format!("kind={}&on_error={on_error}", a.kind);
            if let Some(c) = &config {
                q.push_str(&format!("&config={}", query_value(c)));
            }
            if let Some(v) = a.deadline_ms {
                q.push_str(&format!("&deadline_ms={v}"));
            }
            match a.fuel {
                Some(0) => q.push_str("&fuel=none"),
                Some(v) => q.push_str(&format!("&fuel={v}")),
                None => {}
            }
            if let Some(v) = a.memory_mb {
                q.push_str(&format!("&memory_mb={v}"));
            }
            let path = format!("/admin/policies/{}?{q}", a.name);
            let v = admin(&a.target, Method::PUT, &path, Payload::Wasm(bytes))?;
            serde_json::from_value(v).context("unexpected answer from the gateway")?
        }
    };
    println!(
        "pushed {} ({}, version {}, sha256 {}, {} bytes, exports {})",
        info.name,
        info.kind,
        info.version,
        &info.sha256[..12.min(info.sha256.len())],
        info.size_bytes,
        info.interface
    );
    if let Some(inputs) = &info.decision_inputs {
        if inputs.is_empty() {
            println!("its one decision is reused for every request (it declared no inputs)");
        } else {
            println!(
                "its decisions are reused for requests with the same {}",
                inputs.join(", ")
            );
        }
    }
    Ok(())
}

fn print_list(infos: &[PolicyInfo]) {
    println!(
        "{:<24} {:<18} {:>4} {:<12} {:<12} {:<12} {:>9}",
        "NAME", "KIND", "VER", "ON_ERROR", "BOUND", "SHA256", "BYTES"
    );
    for i in infos {
        let bound: Vec<_> = i.bound_as.iter().map(|k| k.as_str()).collect();
        println!(
            "{:<24} {:<18} {:>4} {:<12} {:<12} {:<12} {:>9}",
            i.name,
            i.kind.as_str(),
            i.version,
            match i.on_error {
                OnError::FailOpen => "fail_open",
                OnError::FailClosed => "fail_closed",
            },
            if bound.is_empty() {
                "-".to_string()
            } else {
                bound.join(",")
            },
            &i.sha256[..12.min(i.sha256.len())],
            i.size_bytes
        );
    }
}

/// One admin API call on the running gateway.
fn admin(t: &Target, method: Method, path: &str, payload: Payload) -> anyhow::Result<Value> {
    call_blocking(&t.remote, method, path, payload)
}

/// Runs a `dataset` subcommand.
pub fn run_dataset(cmd: DatasetCommand) -> anyhow::Result<()> {
    match cmd {
        DatasetCommand::Transform(a) => transform(a),
        DatasetCommand::Preview(a) => preview(a),
    }
}

fn preview(a: PreviewArgs) -> anyhow::Result<()> {
    let steps: serde_json::Value = match (&a.steps, &a.policy) {
        (Some(text), _) => serde_json::from_str(text).context("--steps is not JSON")?,
        (None, Some(name)) => serde_json::json!([{ "policy": name }]),
        (None, None) => anyhow::bail!("give --steps or --policy"),
    };
    let body = serde_json::json!({"steps": steps, "input": a.input, "limit": a.limit});
    let v = super::remote::call_blocking(
        &a.remote,
        http::Method::POST,
        "/api/datasets/preview",
        super::remote::Payload::Json(body),
    )?;
    for r in v["results"].as_array().into_iter().flatten() {
        let at = format!("line {}", r["line"]);
        match r["outcome"].as_str() {
            Some("keep") => println!("{at}: keep {}", r["output"]),
            Some(outcome) => println!(
                "{at}: {outcome} by {}: {}",
                r["step"].as_str().unwrap_or("reading"),
                r["reason"].as_str().unwrap_or("")
            ),
            None => {}
        }
    }
    let c = &v["counts"];
    eprintln!(
        "{} kept, {} dropped, {} failed (nothing written)",
        c["keep"], c["drop"], c["error"]
    );
    Ok(())
}

#[derive(Default)]
struct Tally {
    read: u64,
    kept: u64,
    dropped: u64,
    failed: u64,
}

fn transform(a: TransformArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.batch > 0, "--batch must be at least 1");
    let host = Arc::new(open_local(&a.data_dir)?);
    let info = host.get(&a.policy)?;
    anyhow::ensure!(
        info.kind == PolicyKind::DatasetTransform,
        "policy {} is a {} policy, not a dataset-transform policy",
        a.policy,
        info.kind
    );
    let input =
        File::open(&a.input).with_context(|| format!("cannot open {}", a.input.display()))?;
    let total_bytes = input.metadata().map(|m| m.len()).unwrap_or(0);
    let reader = BufReader::new(input);
    let mut out = BufWriter::new(
        File::create(&a.output).with_context(|| format!("cannot create {}", a.output.display()))?,
    );
    let mut rejects = match &a.rejects {
        Some(p) => Some(BufWriter::new(
            File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => None,
    };

    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut tally = Tally::default();
    let mut batches = JsonlBatches::new(reader, a.batch);
    while let Some(Batch { records, lines }) = batches
        .next_batch()
        .with_context(|| format!("reading {}", a.input.display()))?
    {
        let outcomes = host.transform_batch(&a.policy, &records)?;
        for (outcome, line) in outcomes.iter().zip(&lines) {
            tally.read += 1;
            match outcome {
                RecordOutcome::Keep(json) => {
                    tally.kept += 1;
                    out.write_all(json.as_bytes())?;
                    out.write_all(b"\n")?;
                }
                RecordOutcome::Drop(reason) | RecordOutcome::Error(reason) => {
                    let what = if matches!(outcome, RecordOutcome::Drop(_)) {
                        tally.dropped += 1;
                        "drop"
                    } else {
                        tally.failed += 1;
                        "error"
                    };
                    if let Some(r) = rejects.as_mut() {
                        let rec = json!({"line": line, "outcome": what, "reason": reason});
                        writeln!(r, "{rec}")?;
                    }
                }
            }
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            progress(&tally, batches.consumed(), total_bytes, started.elapsed());
        }
    }
    out.flush()?;
    if let Some(r) = rejects.as_mut() {
        r.flush()?;
    }
    progress(&tally, batches.consumed(), total_bytes, started.elapsed());
    eprintln!(
        "done: {} records in {:.2}s -> {} kept in {}, {} dropped, {} errors",
        tally.read,
        started.elapsed().as_secs_f64(),
        tally.kept,
        a.output.display(),
        tally.dropped,
        tally.failed
    );
    Ok(())
}

fn progress(t: &Tally, consumed: u64, total: u64, elapsed: Duration) {
    let pct = if total > 0 {
        consumed as f64 * 100.0 / total as f64
    } else {
        100.0
    };
    let rate = t.read as f64 / elapsed.as_secs_f64().max(1e-9);
    eprintln!(
        "transform: {pct:5.1}% {} records ({} kept, {} dropped, {} errors), {rate:.0} records/s",
        t.read, t.kept, t.dropped, t.failed
    );
}
