//! `dataset`: runs a JSONL file through a dataset-transform Wasm policy
//! (`PolicyHost::transform_batch`) and writes `train.jsonl`, `valid.jsonl`
//! (when `valid_ratio` > 0) and `rejected.jsonl` (dropped and failed records
//! with their reasons) into `output_dir`.
//!
//! Config: `input`, `output_dir`, `policy` (required), `batch_size` (32),
//! `valid_ratio` (0), `seed` (0). The split is a hash of (seed, index of the
//! kept record), so the same input and seed always give the same split.
//! Files are written as `*.partial` and renamed at the end: a failed or
//! cancelled job never leaves a half-written file under the final name.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::{ConfigError, Env, Fields, Outcome};
use crate::jobs::runner::{JobCtx, RunError};
use crate::jobs::types::JobEvent;
use crate::policy::jsonl::{Batch, JsonlBatches};
use crate::policy::{PolicyHost, PolicyKind, RecordOutcome};

pub struct DatasetSpec {
    input: PathBuf,
    output_dir: PathBuf,
    policy: String,
    host: Arc<PolicyHost>,
    batch_size: usize,
    valid_ratio: f64,
    seed: u64,
}

impl DatasetSpec {
    pub fn parse(mut f: Fields, env: &Env<'_>) -> Result<DatasetSpec, ConfigError> {
        let input = f.input_path("input", env.paths)?;
        if !input.is_file() {
            return Err(ConfigError::new(
                "config.input",
                "`input` must be a JSONL file",
            ));
        }
        let output_dir = f.output_path("output_dir", env.paths)?;
        if output_dir.exists() && !output_dir.is_dir() {
            return Err(ConfigError::new(
                "config.output_dir",
                "`output_dir` exists and is not a folder",
            ));
        }
        let policy = f.string("policy")?;
        let batch_size = f.u64("batch_size", Some(32), 1..=1024)? as usize;
        let valid_ratio = f.f64("valid_ratio", 0.0, 0.0..=0.99)?;
        let seed = f.u64("seed", Some(0), 0..=u64::MAX)?;
        f.finish()?;
        let provider = env
            .policies
            .ok_or_else(|| ConfigError::new("config.policy", "no policy host in this process"))?;
        let host = provider().map_err(|e| {
            ConfigError::new(
                "config.policy",
                format!("the policy store cannot be opened: {e}"),
            )
        })?;
        let info = host
            .get(&policy)
            .map_err(|e| ConfigError::new("config.policy", e.to_string()))?;
        if info.kind != PolicyKind::DatasetTransform {
            return Err(ConfigError::new(
                "config.policy",
                format!(
                    "policy `{policy}` is a {} policy, not a dataset-transform policy",
                    info.kind
                ),
            ));
        }
        Ok(DatasetSpec {
            input,
            output_dir,
            policy,
            host,
            batch_size,
            valid_ratio,
            seed,
        })
    }

    pub fn run(self, ctx: &JobCtx) -> Result<Outcome, RunError> {
        let io = |what: &str, p: &Path| {
            let what = format!("{what} {}", p.display());
            move |e: std::io::Error| RunError::Failed(format!("{what}: {e}"))
        };
        std::fs::create_dir_all(&self.output_dir).map_err(io("cannot create", &self.output_dir))?;
        let input = File::open(&self.input).map_err(io("cannot open", &self.input))?;
        let total = input.metadata().map(|m| m.len()).unwrap_or(0);
        let mut reader = BufReader::new(input);
        let names: &[&str] = if self.valid_ratio > 0.0 {
            &["train.jsonl", "valid.jsonl", "rejected.jsonl"]
        } else {
            &["train.jsonl", "rejected.jsonl"]
        };
        let partial = |n: &str| self.output_dir.join(format!("{n}.partial"));
        let mut outs = Vec::new();
        for n in names {
            let p = partial(n);
            outs.push(BufWriter::new(
                File::create(&p).map_err(io("cannot create", &p))?,
            ));
        }
        let result = self.transform(ctx, &mut reader, total, &mut outs);
        let finished = result.and_then(|tally| {
            for (w, n) in outs.iter_mut().zip(names) {
                w.flush().map_err(io("cannot write", &partial(n)))?;
                w.get_ref()
                    .sync_data()
                    .map_err(io("cannot sync", &partial(n)))?;
            }
            for n in names {
                let to = self.output_dir.join(n);
                std::fs::rename(partial(n), &to).map_err(io("cannot rename to", &to))?;
            }
            Ok(tally)
        });
        let tally = match finished {
            Ok(t) => t,
            Err(e) => {
                for n in names {
                    let _ = std::fs::remove_file(partial(n));
                }
                return Err(e);
            }
        };
        ctx.emit(JobEvent::stage(
            "done",
            Some(1.0),
            Some(format!(
                "{} records: {} kept ({} train, {} valid), {} dropped, {} errors",
                tally.read, tally.kept, tally.train, tally.valid, tally.dropped, tally.errors
            )),
        ));
        Ok(Outcome {
            output_path: Some(self.output_dir.clone()),
            summary: Some(json!({
                "records": tally.read,
                "kept": tally.kept,
                "train": tally.train,
                "valid": tally.valid,
                "dropped": tally.dropped,
                "errors": tally.errors,
                "files": names,
            })),
        })
    }

    fn transform(
        &self,
        ctx: &JobCtx,
        reader: &mut impl BufRead,
        total: u64,
        outs: &mut [BufWriter<File>],
    ) -> Result<Tally, RunError> {
        ctx.emit(JobEvent::stage(
            "transform",
            Some(0.0),
            Some(format!(
                "policy {} over {}",
                self.policy,
                self.input.display()
            )),
        ));
        let mut t = Tally::default();
        let mut step = 0u64;
        let mut batches = JsonlBatches::new(reader, self.batch_size);
        let read_error =
            |e: std::io::Error| RunError::Failed(format!("cannot read the input: {e}"));
        while let Some(Batch { records, lines }) = batches.next_batch().map_err(read_error)? {
            ctx.check()?;
            let outcomes = self
                .host
                .transform_batch(&self.policy, &records)
                .map_err(|e| RunError::Failed(format!("policy {}: {e}", self.policy)))?;
            for ((outcome, line), record) in outcomes.iter().zip(&lines).zip(&records) {
                self.write_outcome(&mut t, outcome, *line, record, outs)
                    .map_err(|e| RunError::Failed(format!("cannot write output: {e}")))?;
            }
            step += 1;
            let progress = if total > 0 {
                batches.consumed() as f64 / total as f64
            } else {
                1.0
            };
            ctx.emit(t.metric(step, progress));
        }
        Ok(t)
    }

    /// Writes one record's outcome: a kept record to the train or valid
    /// file (a seeded draw per kept record), a dropped or failed one to the
    /// rejected file with its line and reason; counts it in `t`.
    fn write_outcome(
        &self,
        t: &mut Tally,
        outcome: &RecordOutcome,
        line: u64,
        record: &str,
        outs: &mut [BufWriter<File>],
    ) -> std::io::Result<()> {
        t.read += 1;
        match outcome {
            RecordOutcome::Keep(json) => {
                let valid =
                    self.valid_ratio > 0.0 && unit_hash(self.seed, t.kept) < self.valid_ratio;
                t.kept += 1;
                let w = if valid {
                    t.valid += 1;
                    &mut outs[1]
                } else {
                    t.train += 1;
                    &mut outs[0]
                };
                w.write_all(json.as_bytes())?;
                w.write_all(b"\n")
            }
            RecordOutcome::Drop(reason) | RecordOutcome::Error(reason) => {
                let what = if matches!(outcome, RecordOutcome::Drop(_)) {
                    t.dropped += 1;
                    "drop"
                } else {
                    t.errors += 1;
                    "error"
                };
                let rec =
                    json!({"line": line, "outcome": what, "reason": reason, "record": record});
                let rejected = outs.len() - 1;
                writeln!(outs[rejected], "{rec}")
            }
        }
    }
}

#[derive(Default)]
struct Tally {
    read: u64,
    kept: u64,
    train: u64,
    valid: u64,
    dropped: u64,
    errors: u64,
}

impl Tally {
    /// The `metric` event after a batch: the counts so far.
    fn metric(&self, step: u64, progress: f64) -> JobEvent {
        let extra = Map::from_iter([
            ("records".to_owned(), Value::from(self.read)),
            ("kept".to_owned(), Value::from(self.kept)),
            ("dropped".to_owned(), Value::from(self.dropped)),
            ("errors".to_owned(), Value::from(self.errors)),
        ]);
        JobEvent::Metric {
            kind: "dataset".into(),
            step,
            loss: None,
            progress: Some(progress),
            message: Some(format!(
                "{} records: {} kept, {} dropped, {} errors",
                self.read, self.kept, self.dropped, self.errors
            )),
            extra,
        }
    }
}

/// A uniform number in [0, 1) from (seed, n): SplitMix64's finaliser.
fn unit_hash(seed: u64, n: u64) -> f64 {
    let mut z = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    #[test]
    fn split_hash_is_uniform_enough() {
        let n = 10_000;
        let valid = (0..n).filter(|&i| super::unit_hash(7, i) < 0.2).count();
        assert!((1700..2300).contains(&valid), "{valid}");
    }
}
