//! `dataset`: runs records through a pipeline of steps ([`crate::datasets`])
//! and writes `train`, `valid` and `test` files (JSONL or Parquet) and
//! `rejected.jsonl` (dropped and failed records with the file, line, step
//! and reason) into `output_dir`.
//!
//! Config:
//! - `input` (required): a file, a folder of shards, or a glob
//!   (`files/data/train-*.parquet`) of `.jsonl`, `.jsonl.gz`, `.jsonl.zst`,
//!   `.csv` or `.parquet` files, under `[jobs] allowed_paths`.
//! - `output_dir` (required), `output_format` (`jsonl` or `parquet`).
//! - `steps`: `[{"policy": NAME}, {"dedupe": [FIELDS]}, {"filter_length":
//!   {"model": PATH, "min_tokens": N, "max_tokens": M}}]`, applied in order;
//!   `policy` alone is shorthand for one policy step.
//! - `valid_ratio`, `test_ratio` (0; together below 1), `seed` (0): the
//!   split, a hash of (seed, index of the kept record).
//! - `shuffle`: `true` (with `seed`) or a seed of its own: the kept records
//!   in a seeded random order, before the split, with bounded memory
//!   (`datasets::shuffle`). A shuffled run does not resume (it starts over).
//! - `batch_size` (32 records per guest call), `workers` (0: one per core),
//!   `bad_records` (`fail`: a record that cannot be read fails the job,
//!   naming the file and line; `reject`: it goes to the rejected file).
//!
//! Files are written as `*.partial` and renamed at the end: a failed or
//! cancelled job never leaves a half-written file under a final name.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::{ConfigError, Env, Fields, Outcome};
use crate::datasets::{
    BadRecords, DatasetError, Observer, OutputFormat, Pipeline, PreviewInput, Progress, Reader,
    Run, Shard, Split, Step,
};
use crate::jobs::runner::{JobCtx, RunError};
use crate::jobs::types::JobEvent;
use crate::policy::{PolicyHost, PolicyKind};

pub struct DatasetSpec {
    /// The submitted config's text, part of the checkpoint key.
    config: String,
    shards: Vec<Shard>,
    output_dir: PathBuf,
    pipeline: Pipeline,
    format: OutputFormat,
    split: Split,
    batch_size: usize,
    workers: usize,
    bad_records: BadRecords,
    shuffle: Option<u64>,
}

impl DatasetSpec {
    pub fn parse(mut f: Fields, env: &Env<'_>) -> Result<DatasetSpec, ConfigError> {
        let shards = input_shards(&mut f, env)?;
        let output_dir = f.output_path("output_dir", env.paths)?;
        if output_dir.exists() && !output_dir.is_dir() {
            return Err(ConfigError::new(
                "config.output_dir",
                "`output_dir` exists and is not a folder",
            ));
        }
        let format = f.choice(
            "output_format",
            &[
                ("jsonl", OutputFormat::Jsonl),
                ("parquet", OutputFormat::Parquet),
            ],
        )?;
        let shorthand = f.take("policy");
        let steps = match (f.take("steps"), shorthand.as_ref().and_then(Value::as_str)) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "config.policy",
                    "give `steps` or `policy`, not both",
                ));
            }
            (Some(steps), None) => steps,
            (None, Some(policy)) => json!([{ "policy": policy }]),
            (None, None) if shorthand.is_some() => {
                return Err(ConfigError::new(
                    "config.policy",
                    "`policy` must be a string",
                ));
            }
            (None, None) => {
                return Err(ConfigError::new(
                    "config.steps",
                    "`steps` is required: a list such as [{\"policy\": \"alpaca\"}, {\"dedupe\": [\"messages\"]}] (or `policy` for one policy)",
                ));
            }
        };
        let batch_size = f.u64("batch_size", Some(32), 1..=1024)? as usize;
        let valid = f.f64("valid_ratio", 0.0, 0.0..=0.99)?;
        let test = f.f64("test_ratio", 0.0, 0.0..=0.99)?;
        if valid + test >= 1.0 {
            return Err(ConfigError::new(
                "config.test_ratio",
                "`valid_ratio` + `test_ratio` must be below 1 (the rest is train)",
            ));
        }
        let seed = f.u64("seed", Some(0), 0..=u64::MAX)?;
        let workers = f.u64("workers", Some(0), 0..=64)? as usize;
        let shuffle = match f.take("shuffle") {
            None | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(seed),
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                ConfigError::new(
                    "config.shuffle",
                    "`shuffle` is true (with `seed`), false, or a seed (a non-negative integer)",
                )
            })?),
        };
        let bad_records = f.choice(
            "bad_records",
            &[("fail", BadRecords::Fail), ("reject", BadRecords::Reject)],
        )?;
        f.finish()?;
        let pipeline = parse_steps(&steps, "config.steps", env).map_err(|mut e| {
            if shorthand.is_some() {
                e.param = "config.policy".into();
            }
            e
        })?;
        let workers = if workers == 0 {
            std::thread::available_parallelism().map_or(2, |n| n.get())
        } else {
            workers
        };
        Ok(DatasetSpec {
            config: String::new(),
            shards,
            output_dir,
            pipeline,
            format,
            split: Split { valid, test, seed },
            batch_size,
            workers,
            bad_records,
            shuffle,
        })
    }

    /// Keys the run's checkpoint to `config` (with its input files'
    /// sizes and times): the same config over the same input resumes.
    pub fn with_config(mut self, config: &Value) -> Self {
        self.config = config.to_string();
        self
    }

    fn checkpoint_key(&self, shards: &[Shard]) -> String {
        let mut text = self.config.clone();
        for s in shards {
            let modified = s
                .path
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            text.push_str(&format!("\n{} {} {modified}", s.path.display(), s.bytes));
        }
        format!("{:032x}", xxhash_rust::xxh3::xxh3_128(text.as_bytes()))
    }

    pub fn run(self, ctx: &JobCtx) -> Result<Outcome, RunError> {
        let total: u64 = self.shards.iter().map(|s| s.bytes).sum();
        ctx.emit(JobEvent::stage(
            "read",
            Some(0.0),
            Some(format!(
                "{} file(s), {} bytes: {}; steps: {}; {} workers",
                self.shards.len(),
                total,
                shard_list(&self.shards),
                step_list(self.pipeline.steps()),
                self.workers
            )),
        ));
        let shard_count = self.shards.len();
        let checkpoint_key = Some(self.checkpoint_key(&self.shards));
        let run = Run {
            reader: Reader::new(self.shards, self.bad_records),
            pipeline: &self.pipeline,
            output_dir: &self.output_dir,
            format: self.format,
            split: self.split,
            batch_size: self.batch_size,
            workers: self.workers,
            checkpoint_key,
            shuffle: self.shuffle,
        };
        let names = self.split.names();
        let mut events = JobEvents {
            ctx,
            step: 0,
            names: &names,
        };
        let result = run.run(&mut events);
        let (tally, files) = match result {
            Ok(done) => done,
            Err(DatasetError::Cancelled) => {
                return Err(ctx
                    .check()
                    .err()
                    .unwrap_or_else(|| RunError::Failed("cancelled".into())));
            }
            Err(e) => return Err(RunError::Failed(e.to_string())),
        };
        let mut split_counts = Map::new();
        for (name, n) in names.iter().zip(tally.per_split) {
            split_counts.insert((*name).to_owned(), n.into());
        }
        ctx.emit(JobEvent::stage(
            "done",
            Some(1.0),
            Some(format!(
                "{} records: {} kept ({}), {} dropped, {} errors",
                tally.read,
                tally.kept,
                names
                    .iter()
                    .zip(tally.per_split)
                    .map(|(n, c)| format!("{c} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                tally.dropped,
                tally.errors
            )),
        ));
        let file_names: Vec<String> = files
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        let mut summary = json!({
            "records": tally.read,
            "kept": tally.kept,
            "dropped": tally.dropped,
            "errors": tally.errors,
            "files": file_names,
            "input_files": shard_count,
        });
        if let Value::Object(o) = &mut summary {
            o.extend(split_counts);
        }
        Ok(Outcome {
            output_path: Some(self.output_dir.clone()),
            summary: Some(summary),
        })
    }
}

/// The job's progress as events; cancellation from the job's flag.
struct JobEvents<'a> {
    ctx: &'a JobCtx,
    step: u64,
    names: &'a [&'static str],
}

impl Observer for JobEvents<'_> {
    fn progress(&mut self, p: &Progress) {
        self.step += 1;
        self.ctx.emit(metric(self.step, p, self.names));
    }

    fn resumed(&mut self, records: u64) {
        self.ctx.emit(JobEvent::stage(
            "resume",
            None,
            Some(format!(
                "resuming an interrupted run of this config after its first {records} records"
            )),
        ));
    }

    fn cancelled(&self) -> bool {
        self.ctx.check().is_err()
    }
}

/// `input`: a file, folder or glob under the allowed paths, and every shard
/// it names (each checked again, after symlinks, against the same folders).
fn input_shards(f: &mut Fields, env: &Env<'_>) -> Result<Vec<Shard>, ConfigError> {
    let raw = f.string("input")?;
    shards_of(&raw, "config.input", env)
}

/// The first `limit` records of the input `raw` names, each with where it
/// came from (a preview).
pub fn read_head(raw: &str, env: &Env<'_>, limit: usize) -> Result<Vec<PreviewInput>, ConfigError> {
    let shards = shards_of(raw, "input", env)?;
    let mut reader = Reader::new(shards, BadRecords::Reject);
    let records = reader
        .next_batch(limit)
        .map_err(|e| ConfigError::new("input", e.to_string()))?;
    Ok(records
        .into_iter()
        .map(|r| PreviewInput {
            origin: Some((reader.shards()[r.shard].path.clone(), r.row)),
            text: r.text,
            unreadable: r.unreadable,
        })
        .collect())
}

fn shards_of(raw: &str, param: &str, env: &Env<'_>) -> Result<Vec<Shard>, ConfigError> {
    let bad = |m: String| ConfigError::new(param, m);
    let is_glob = raw.contains(['*', '?', '[']);
    let spec = if is_glob {
        env.paths.writable(raw)
    } else {
        env.paths.existing(raw)
    }
    .map_err(|e| bad(e.to_string()))?;
    let shards = crate::datasets::resolve(&spec).map_err(|e| bad(e.to_string()))?;
    for s in &shards {
        env.paths
            .existing(&s.path.to_string_lossy())
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok(shards)
}

/// Parses and checks a `steps` list (the job's, or a preview's); `param`
/// names the list in errors (`config.steps[1].policy`).
pub fn parse_steps(steps: &Value, param: &str, env: &Env<'_>) -> Result<Pipeline, ConfigError> {
    let list = steps
        .as_array()
        .ok_or_else(|| ConfigError::new(param, "`steps` must be a list of steps"))?;
    let mut out = Vec::with_capacity(list.len());
    let mut host: Option<Arc<PolicyHost>> = None;
    for (i, step) in list.iter().enumerate() {
        let at = format!("{param}[{i}]");
        let one = step
            .as_object()
            .filter(|o| o.len() == 1)
            .and_then(|o| o.iter().next())
            .map(|(k, v)| (k.as_str(), v))
            .ok_or_else(|| {
                ConfigError::new(
                    &at,
                    "a step is an object with one key: `policy`, `dedupe` or `filter_length`",
                )
            })?;
        out.push(match one {
            ("policy", Value::String(name)) => {
                let h = match &host {
                    Some(h) => h.clone(),
                    None => host.insert(policy_host(env, &at)?).clone(),
                };
                check_transform(&h, name, &format!("{at}.policy"))?;
                Step::Transform(name.clone())
            }
            ("dedupe", Value::Array(fields)) => {
                let fields = fields
                    .iter()
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        ConfigError::new(format!("{at}.dedupe"), "`dedupe` is a list of field names ([] for the whole record)")
                    })?;
                Step::Dedupe(fields)
            }
            ("filter_length", Value::Object(o)) => filter_length(o, &at, env)?,
            (key, _) => {
                return Err(ConfigError::new(
                    format!("{at}.{key}"),
                    format!("unknown step `{key}` or wrong value: steps are {{\"policy\": NAME}}, {{\"dedupe\": [FIELDS]}} and {{\"filter_length\": {{\"model\": PATH, \"min_tokens\": N, \"max_tokens\": M}}}}"),
                ));
            }
        });
    }
    Ok(Pipeline::new(out, host))
}

fn policy_host(env: &Env<'_>, at: &str) -> Result<Arc<PolicyHost>, ConfigError> {
    let provider = env
        .policies
        .ok_or_else(|| ConfigError::new(at, "no policy host in this process"))?;
    provider().map_err(|e| ConfigError::new(at, format!("the policy store cannot be opened: {e}")))
}

fn check_transform(host: &PolicyHost, name: &str, at: &str) -> Result<(), ConfigError> {
    let info = host
        .get(name)
        .map_err(|e| ConfigError::new(at, e.to_string()))?;
    if info.kind != PolicyKind::DatasetTransform {
        return Err(ConfigError::new(
            at,
            format!(
                "policy `{name}` is a {} policy, not a dataset-transform policy",
                info.kind
            ),
        ));
    }
    Ok(())
}

fn filter_length(o: &Map<String, Value>, at: &str, env: &Env<'_>) -> Result<Step, ConfigError> {
    let mut f = Fields::new(&Value::Object(o.clone()))?;
    let param = |key: &str| format!("{at}.filter_length.{key}");
    let relabel = |e: ConfigError| {
        let key = e.param.trim_start_matches("config.").to_owned();
        ConfigError::new(param(&key), e.message)
    };
    let model = f.input_path("model", env.paths).map_err(relabel)?;
    let min_tokens = f
        .u64("min_tokens", Some(0), 0..=u64::MAX)
        .map_err(relabel)?;
    let max_tokens = f
        .u64("max_tokens", Some(u64::MAX), 1..=u64::MAX)
        .map_err(relabel)?;
    f.finish().map_err(relabel)?;
    if min_tokens > max_tokens {
        return Err(ConfigError::new(
            param("min_tokens"),
            "`min_tokens` is above `max_tokens`",
        ));
    }
    let codec = crate::engine::load_text_codec(&model).map_err(|e| {
        ConfigError::new(
            param("model"),
            format!("cannot load the tokenizer of {}: {e}", model.display()),
        )
    })?;
    Ok(Step::FilterLength {
        codec: Arc::new(codec),
        min_tokens,
        max_tokens,
    })
}

fn shard_list(shards: &[Shard]) -> String {
    let name = |p: &Path| {
        p.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    };
    match shards {
        [one] => name(&one.path),
        [first, .., last] => format!("{} .. {}", name(&first.path), name(&last.path)),
        [] => String::new(),
    }
}

fn step_list(steps: &[Step]) -> String {
    if steps.is_empty() {
        return "none".into();
    }
    steps
        .iter()
        .map(Step::label)
        .collect::<Vec<_>>()
        .join(" -> ")
}

/// The `metric` event of a progress report: counts, rate and ETA.
fn metric(step: u64, p: &Progress, names: &[&str]) -> JobEvent {
    let t = &p.tally;
    let mut extra = Map::from_iter([
        ("records".to_owned(), Value::from(t.read)),
        ("kept".to_owned(), Value::from(t.kept)),
        ("dropped".to_owned(), Value::from(t.dropped)),
        ("errors".to_owned(), Value::from(t.errors)),
        (
            "records_per_sec".to_owned(),
            Value::from((p.records_per_sec * 10.0).round() / 10.0),
        ),
    ]);
    if let Some(eta) = p.eta_secs {
        extra.insert("eta_secs".to_owned(), Value::from(eta.round()));
    }
    for (name, n) in names.iter().zip(t.per_split) {
        extra.insert((*name).to_owned(), Value::from(n));
    }
    let eta = p
        .eta_secs
        .map_or_else(String::new, |s| format!(", about {s:.0} s left"));
    JobEvent::Metric {
        kind: "dataset".into(),
        step,
        loss: None,
        progress: Some(p.fraction),
        message: Some(format!(
            "{} records: {} kept, {} dropped, {} errors; {:.0} records/s{eta}",
            t.read, t.kept, t.dropped, t.errors, p.records_per_sec
        )),
        extra,
    }
}
