//! Dataset processing: records read from JSONL (plain, gzip, zstd), CSV or
//! Parquet shards ([`input`]), run through a pipeline of steps ([`pipeline`]:
//! Wasm transforms, dedupe, a token-length filter) on a pool of threads,
//! split into train / valid / test and written as JSONL or Parquet
//! ([`output`]). The `dataset` job and the preview API use
//! it; it knows nothing of either.

pub mod checkpoint;
pub mod input;
pub mod output;
pub mod pipeline;
pub mod shuffle;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

pub use input::{BadRecords, Format, Reader, Record, Shard, resolve};
pub use output::{OutputFile, OutputFormat};
pub use pipeline::{Fate, Pipeline, PipelineState, Step, StepFailed};

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
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Checkpoint the run under this key (of its config and input), and
    /// resume from a checkpoint with the same key ([`checkpoint`]; not
    /// with `shuffle`).
    pub checkpoint_key: Option<String>,
    /// Shuffle the kept records with this seed before the split
    /// ([`shuffle`]).
    pub shuffle: Option<u64>,
}

/// What a run tells its caller as it goes.
pub trait Observer {
    /// About twice a second, and at the end.
    fn progress(&mut self, p: &Progress);
    /// Once, when the run picks up an interrupted one after `records`.
    fn resumed(&mut self, records: u64);
    /// Asked before each batch.
    fn cancelled(&self) -> bool;
}

/// How often a checkpointed run saves where it is.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(2);

impl Run<'_> {
    /// Runs to the end, writing the split files and `rejected.jsonl`, all
    /// renamed into place only on success. A cancelled run keeps its
    /// `.partial` files and checkpoint to resume from; a failed one removes
    /// them.
    pub fn run(
        mut self,
        observer: &mut dyn Observer,
    ) -> Result<(Tally, Vec<PathBuf>), DatasetError> {
        std::fs::create_dir_all(self.output_dir)
            .map_err(|e| DatasetError::io(self.output_dir, e))?;
        let mut names: Vec<String> = self
            .split
            .names()
            .iter()
            .map(|n| format!("{n}.{}", self.format.extension()))
            .collect();
        names.push("rejected.jsonl".into());
        let mut checkpoints = self
            .checkpoint_key
            .take()
            .filter(|_| self.format == OutputFormat::Jsonl && self.shuffle.is_none())
            .map(|key| checkpoint::Checkpoints::new(self.output_dir, key));
        let resumed = checkpoints.as_mut().and_then(checkpoint::Checkpoints::load);
        let (mut files, mut tally, mut state) = match resumed {
            Some((saved, state)) if saved.files.iter().map(|f| &f.0).eq(names.iter()) => {
                let mut files = Vec::with_capacity(names.len());
                for (name, bytes, records) in &saved.files {
                    files.push(OutputFile::resume(self.output_dir, name, *bytes, *records)?);
                }
                self.reader.skip(saved.tally.read)?;
                observer.resumed(saved.tally.read);
                (files, saved.tally, state)
            }
            _ => {
                if let Some(c) = &checkpoints {
                    c.clear();
                }
                let mut files = Vec::with_capacity(names.len());
                for (i, name) in names.iter().enumerate() {
                    let format = if i + 1 == names.len() {
                        OutputFormat::Jsonl
                    } else {
                        self.format
                    };
                    files.push(OutputFile::create(self.output_dir, name, format)?);
                }
                (files, Tally::default(), PipelineState::default())
            }
        };
        let mut shuffler = match self.shuffle {
            Some(seed) => Some(shuffle::Shuffler::new(self.output_dir, seed)?),
            None => None,
        };
        let started = Instant::now();
        let skipped = tally.read;
        let mut last_report = started;
        let mut last_checkpoint = started;
        let total = self.reader.total_bytes().max(1);
        let shards: Vec<PathBuf> = self
            .reader
            .shards()
            .iter()
            .map(|s| s.path.clone())
            .collect();
        // (Shared by the two closures below, which run on this thread.)
        let origins: RefCell<VecDeque<Vec<Record>>> = RefCell::default();
        let fraction = Cell::new(0.0);
        let split = self.split;
        let pipeline = self.pipeline;
        let reader = &mut self.reader;
        let batch_size = self.batch_size;
        let observer = RefCell::new(observer);
        let result = pipeline.run_parallel::<DatasetError>(
            self.workers,
            &mut state,
            || {
                if observer.borrow().cancelled() {
                    return Err(DatasetError::Cancelled);
                }
                let batch = reader.next_batch(batch_size)?;
                fraction.set(reader.done_bytes() as f64 / total as f64);
                if batch.is_empty() {
                    return Ok(None);
                }
                // Unreadable records go through as empty text; `write_fate`
                // sets their fate aside and rejects them with the reason.
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
            |fates, state| {
                let records = origins.borrow_mut().pop_front().unwrap_or_default();
                for (fate, record) in fates.into_iter().zip(&records) {
                    write_fate(
                        (&mut files, shuffler.as_mut()),
                        &mut tally,
                        (fate, record),
                        (&split, pipeline, &shards),
                    )?;
                }
                if let Some(c) = checkpoints.as_mut()
                    && last_checkpoint.elapsed() >= CHECKPOINT_EVERY
                {
                    last_checkpoint = Instant::now();
                    c.save(&tally, &mut files, state)?;
                }
                if last_report.elapsed() >= Duration::from_millis(500) {
                    last_report = Instant::now();
                    let p = progress(tally, skipped, fraction.get(), started);
                    observer.borrow_mut().progress(&p);
                }
                Ok(())
            },
        );
        let observer = observer.into_inner();
        match result {
            Ok(()) => {}
            Err(DatasetError::Cancelled) => {
                // The partial files and the last checkpoint stay, to resume.
                return Err(DatasetError::Cancelled);
            }
            Err(e) => {
                for f in files {
                    f.discard();
                }
                if let Some(s) = shuffler {
                    s.discard();
                }
                if let Some(c) = &checkpoints {
                    c.clear();
                }
                return Err(e);
            }
        }
        if let Some(s) = shuffler {
            // The kept records, shuffled, to their splits.
            let mut n = 0;
            s.drain(|text| {
                let i = split.pick(n);
                n += 1;
                tally.per_split[i] += 1;
                files[i].write(text)
            })?;
        }
        observer.progress(&progress(tally, skipped, 1.0, started));
        let mut written = Vec::with_capacity(files.len());
        for f in files {
            written.push(f.commit()?);
        }
        if let Some(c) = &checkpoints {
            c.clear();
        }
        Ok((tally, written))
    }
}

/// Writes one record's fate: a kept record to its split's file, a dropped
/// or failed one to `rejected.jsonl` (the last file) with where it came
/// from and why.
fn write_fate(
    (files, shuffler): (&mut [OutputFile], Option<&mut shuffle::Shuffler>),
    tally: &mut Tally,
    (fate, record): (Fate, &Record),
    (split, pipeline, shards): (&Split, &Pipeline, &[PathBuf]),
) -> Result<(), DatasetError> {
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
        return files[last].write(&rejected("error", None, why));
    }
    match fate {
        Fate::Keep(text) => {
            if let Some(s) = shuffler {
                tally.kept += 1;
                return s.push(&text);
            }
            let i = split.pick(tally.kept);
            tally.kept += 1;
            tally.per_split[i] += 1;
            files[i].write(&text)
        }
        Fate::Drop { step, reason } => {
            tally.dropped += 1;
            files[last].write(&rejected("drop", Some(step), &reason))
        }
        Fate::Error { step, reason } => {
            tally.errors += 1;
            files[last].write(&rejected("error", Some(step), &reason))
        }
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

/// `skipped`: records a resumed run took over, not counted in its rate.
fn progress(tally: Tally, skipped: u64, fraction: f64, started: Instant) -> Progress {
    let secs = started.elapsed().as_secs_f64().max(1e-3);
    let rate = (tally.read - skipped) as f64 / secs;
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
