//! A dataset run's checkpoint, in its output folder, so a run that was
//! cancelled or killed (even `kill -9`) and is started again with the same
//! config and input resumes where it was instead of starting over.
//!
//! Every few seconds the run makes its `.partial` files durable and writes
//! `.checkpoint.state.<seq>` (what the pipeline remembers: the dedupe
//! hashes) and then `.checkpoint.json` (the counts, each file's length, and
//! `seq`), each by a rename, so the JSON always names a complete state file.
//! A resumed run cuts each file back to its checkpointed length, skips the
//! records already handled and goes on; its output is byte for byte what an
//! uninterrupted run writes. The JSON holds a key of the job's config and
//! its input files' sizes and times: a changed config or input starts over.
//! JSONL output only: a Parquet file cannot be reopened for appending, so a
//! Parquet run starts over.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::pipeline::PipelineState;
use super::{DatasetError, OutputFile, Tally};

#[derive(Debug, Serialize, Deserialize)]
pub struct Saved {
    key: String,
    seq: u64,
    pub tally: Tally,
    /// Per output file, in order: name, bytes, records.
    pub files: Vec<(String, u64, u64)>,
}

pub struct Checkpoints {
    dir: PathBuf,
    key: String,
    seq: u64,
}

impl Checkpoints {
    pub fn new(dir: &Path, key: String) -> Checkpoints {
        Checkpoints {
            dir: dir.to_owned(),
            key,
            seq: 0,
        }
    }

    fn json(&self) -> PathBuf {
        self.dir.join(".checkpoint.json")
    }

    fn state(&self, seq: u64) -> PathBuf {
        self.dir.join(format!(".checkpoint.state.{seq}"))
    }

    /// The last checkpoint of a run with this key, if there is a whole one.
    pub fn load(&mut self) -> Option<(Saved, PipelineState)> {
        let text = std::fs::read_to_string(self.json()).ok()?;
        let saved: Saved = serde_json::from_str(&text).ok()?;
        if saved.key != self.key {
            return None;
        }
        let state = PipelineState::from_bytes(&std::fs::read(self.state(saved.seq)).ok()?)?;
        self.seq = saved.seq;
        Some((saved, state))
    }

    /// Makes `files` durable and records where they stand. Does nothing
    /// when a file cannot be resumed (Parquet).
    pub fn save(
        &mut self,
        tally: &Tally,
        files: &mut [OutputFile],
        state: &PipelineState,
    ) -> Result<(), DatasetError> {
        let mut lengths = Vec::with_capacity(files.len());
        for f in files.iter_mut() {
            let Some(bytes) = f.checkpoint()? else {
                return Ok(());
            };
            lengths.push((f.name().to_owned(), bytes, f.records()));
        }
        let seq = self.seq + 1;
        write_atomic(&self.state(seq), &state.to_bytes())?;
        let saved = Saved {
            key: self.key.clone(),
            seq,
            tally: *tally,
            files: lengths,
        };
        let json = serde_json::to_vec(&saved).map_err(|e| DatasetError::Output {
            file: self.json(),
            message: e.to_string(),
        })?;
        write_atomic(&self.json(), &json)?;
        let _ = std::fs::remove_file(self.state(self.seq));
        self.seq = seq;
        Ok(())
    }

    /// Removes the checkpoint (the run finished, or failed for good).
    pub fn clear(&self) {
        let _ = std::fs::remove_file(self.json());
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with(".checkpoint.state.")
                {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DatasetError> {
    let tmp = path.with_extension("tmp");
    let io = |e| DatasetError::io(path, e);
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    std::io::Write::write_all(&mut f, bytes).map_err(io)?;
    f.sync_data().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}
