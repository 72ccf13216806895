//! Dataset processing: records read from JSONL (plain, gzip, zstd), CSV or
//! Parquet shards ([`input`]), run through a pipeline of steps ([`pipeline`]:
//! Wasm transforms, dedupe, a token-length filter) on a pool of threads,
//! split into train / valid / test and written as JSONL or Parquet
//! ([`output`]). The `dataset` job ([`crate::jobs`]) and the preview API use
//! it; it knows nothing of either.

pub mod input;
pub mod output;
pub mod pipeline;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

pub use input::{BadRecords, Format, Reader, Record, Shard, resolve};
pub use output::{OutputFile, OutputFormat};
pub use pipeline::{Fate, Pipeline, Step, StepFailed};

/// Why a dataset run stopped.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("no input: {0}")]
    NoInput(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A record (or the file around it) cannot be read: names the file and
    /// its line or row.
    #[error("{} {}: {message}", file.display(), row_label(*row))]
    Record {
        file: PathBuf,
        row: u64,
        message: String,
    },
    #[error("{}: {message}", file.display())]
    Output { file: PathBuf, message: String },
    #[error(transparent)]
    Step(#[from] StepFailed),
    #[error("cancelled")]
    Cancelled,
}

fn row_label(row: u64) -> String {
    if row == 0 {
        "(header)".into()
    } else {
        format!("line/row {row}")
    }
}

impl DatasetError {
    pub fn io(path: &Path, source: std::io::Error) -> DatasetError {
        DatasetError::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// How kept records are split: `valid` and `test` are fractions; the rest
/// is train. The draw is a hash of (`seed`, index of the kept record), so
/// the same input and seed always split alike.
#[derive(Debug, Clone, Copy, Default)]
pub struct Split {
    pub valid: f64,
    pub test: f64,
    pub seed: u64,
}

impl Split {
    /// The split files, in order: train, then valid and test when used.
    pub fn names(&self) -> Vec<&'static str> {
        let mut names = vec!["train"];
        if self.valid > 0.0 {
            names.push("valid");
        }
        if self.test > 0.0 {
            names.push("test");
        }
        names
    }

    /// Index into [`Split::names`] of the `n`-th kept record.
    fn pick(&self, n: u64) -> usize {
        let u = unit_hash(self.seed, n);
        if u < self.valid {
            1
        } else if u < self.valid + self.test {
            self.names().len() - 1
        } else {
            0
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

/// Counts of a run so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tally {
    pub read: u64,
    pub kept: u64,
    pub dropped: u64,
    pub errors: u64,
    /// Kept records per split, in [`Split::names`] order.
    pub per_split: [u64; 3],
}

/// How far a run is, for progress reports.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub tally: Tally,
    /// Fraction of the input bytes read.
    pub fraction: f64,
    pub records_per_sec: f64,
    /// Seconds left at the rate so far, once it can be told.
    pub eta_secs: Option<f64>,
}

/// A dataset run: where it reads, what it runs, where it writes.
pub struct Run<'a> {
    pub reader: Reader,
    pub pipeline: &'a Pipeline,
    pub output_dir: &'a Path,
    pub format: OutputFormat,
    pub split: Split,
    pub batch_size: usize,
    pub workers: usize,
}

impl Run<'_> {
    /// Runs to the end, writing the split files and `rejected.jsonl`, all
    /// renamed into place only on success. `report` is called about twice a
    /// second and at the end; `cancelled` is asked before each batch.
    pub fn run(
        mut self,
        mut report: impl FnMut(&Progress),
        cancelled: impl Fn() -> bool,
    ) -> Result<(Tally, Vec<PathBuf>), DatasetError> {
        std::fs::create_dir_all(self.output_dir)
            .map_err(|e| DatasetError::io(self.output_dir, e))?;
        let names = self.split.names();
        let mut files = Vec::with_capacity(names.len() + 1);
        for n in &names {
            let name = format!("{n}.{}", self.format.extension());
            files.push(OutputFile::create(self.output_dir, &name, self.format)?);
        }
        files.push(OutputFile::create(
            self.output_dir,
            "rejected.jsonl",
            OutputFormat::Jsonl,
        )?);
        let started = Instant::now();
        let mut last_report = started;
        let total = self.reader.total_bytes().max(1);
        let mut tally = Tally::default();
        let shards: Vec<PathBuf> = self
            .reader
            .shards()
            .iter()
            .map(|s| s.path.clone())
            .collect();
        // Where each record of the batches in flight came from, in order.
        // (Shared by the two closures below, which run on this thread.)
        let origins: RefCell<VecDeque<Vec<Record>>> = RefCell::default();
        let fraction = Cell::new(0.0);
        let split = self.split;
        let pipeline = self.pipeline;
        let reader = &mut self.reader;
        let done_bytes = |r: &Reader| r.done_bytes() as f64 / total as f64;
        let result = pipeline.run_parallel::<DatasetError>(
            self.workers,
            || {
                if cancelled() {
                    return Err(DatasetError::Cancelled);
                }
                let batch = reader.next_batch(self.batch_size)?;
                fraction.set(done_bytes(reader));
                if batch.is_empty() {
                    return Ok(None);
                }
                // Unreadable records skip the steps: an empty text marks them.
                let texts = batch
                    .iter()
                    .map(|r| {
                        if r.unreadable.is_some() {
                            String::new()
                        } else {
                            r.text.clone()
                        }
                    })
                    .collect();
                origins.borrow_mut().push_back(batch);
                Ok(Some(texts))
            },
            |fates| {
                let records = origins.borrow_mut().pop_front().unwrap_or_default();
                for (fate, record) in fates.into_iter().zip(&records) {
                    tally.read += 1;
                    let rejected = |outcome: &str, step: Option<usize>, reason: &str| {
                        json!({
                            "file": shards[record.shard].display().to_string(),
                            "line": record.row,
                            "step": step.map(|s| pipeline.steps()[s].label()),
                            "outcome": outcome,
                            "reason": reason,
                            "record": record.text,
                        })
                        .to_string()
                    };
                    let last = files.len() - 1;
                    if let Some(why) = &record.unreadable {
                        tally.errors += 1;
                        files[last].write(&rejected("error", None, why))?;
                        continue;
                    }
                    match fate {
                        Fate::Keep(text) => {
                            let i = split.pick(tally.kept);
                            tally.kept += 1;
                            tally.per_split[i] += 1;
                            files[i].write(&text)?;
                        }
                        Fate::Drop { step, reason } => {
                            tally.dropped += 1;
                            files[last].write(&rejected("drop", Some(step), &reason))?;
                        }
                        Fate::Error { step, reason } => {
                            tally.errors += 1;
                            files[last].write(&rejected("error", Some(step), &reason))?;
                        }
                    }
                }
                if last_report.elapsed() >= Duration::from_millis(500) {
                    last_report = Instant::now();
                    report(&progress(tally, fraction.get(), started));
                }
                Ok(())
            },
        );
        if let Err(e) = result {
            for f in files {
                f.discard();
            }
            return Err(e);
        }
        report(&progress(tally, 1.0, started));
        let mut written = Vec::with_capacity(files.len());
        for f in files {
            written.push(f.commit()?);
        }
        Ok((tally, written))
    }
}

/// A pipeline's outcome on a few records, nothing written: the step names,
/// and each record (with the file and line it came from, when read from
/// files) and its fate.
#[derive(Debug)]
pub struct Preview {
    pub steps: Vec<String>,
    pub rows: Vec<PreviewRow>,
}

#[derive(Debug)]
pub struct PreviewRow {
    /// The file and line it was read from, when read from files.
    pub origin: Option<(PathBuf, u64)>,
    pub input: String,
    pub fate: Fate,
}

/// A record to preview: its text and where it came from; `unreadable` says
/// why it could not be read (it then skips the steps, as in a job).
pub struct PreviewInput {
    pub origin: Option<(PathBuf, u64)>,
    pub text: String,
    pub unreadable: Option<String>,
}

impl Preview {
    pub fn run(pipeline: &Pipeline, records: Vec<PreviewInput>) -> Result<Preview, StepFailed> {
        let texts = records.iter().map(|r| r.text.clone()).collect();
        let fates = pipeline.run_once(texts)?;
        Ok(Preview {
            steps: pipeline.steps().iter().map(Step::label).collect(),
            rows: records
                .into_iter()
                .zip(fates)
                .map(|(r, fate)| PreviewRow {
                    origin: r.origin,
                    input: r.text,
                    fate: match r.unreadable {
                        Some(reason) => Fate::Error {
                            step: usize::MAX,
                            reason,
                        },
                        None => fate,
                    },
                })
                .collect(),
        })
    }
}

fn progress(tally: Tally, fraction: f64, started: Instant) -> Progress {
    let secs = started.elapsed().as_secs_f64().max(1e-3);
    let rate = tally.read as f64 / secs;
    let eta = (fraction > 0.01 && fraction < 1.0).then(|| secs * (1.0 - fraction) / fraction);
    Progress {
        tally,
        fraction: fraction.min(1.0),
        records_per_sec: rate,
        eta_secs: eta,
    }
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
