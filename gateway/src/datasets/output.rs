//! The files a dataset job writes: one per split (`train`, `valid`, `test`)
//! in JSONL or Parquet, and `rejected.jsonl` (always JSONL: dropped and
//! failed records with their reasons). Each is written as `<name>.partial`
//! and renamed only when the whole job succeeded, so a failed or cancelled
//! job never leaves a half-written file under a final name.
//!
//! Parquet needs a schema before its first row: it is inferred (arrow-json)
//! from the first 1,024 records of the file, then every record must fit it;
//! one that does not (a field no earlier record had, a string where numbers
//! were) fails the job saying so. Columns are zstd-compressed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_json::reader::{Decoder, ReaderBuilder, infer_json_schema_from_iterator};
use arrow_schema::Schema;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use super::DatasetError;

/// How kept records are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    #[default]
    Jsonl,
    Parquet,
}

impl OutputFormat {
    pub fn extension(self) -> &'static str {
        match self {
            OutputFormat::Jsonl => "jsonl",
            OutputFormat::Parquet => "parquet",
        }
    }
}

/// Records of a Parquet file's start, from which its schema is inferred.
const SCHEMA_SAMPLE: usize = 1024;
/// Rows decoded into one Arrow batch before it is written.
const ROWS_PER_BATCH: usize = 1024;

/// One output file, written under `<name>.partial` until [`OutputFile::commit`].
pub struct OutputFile {
    name: String,
    partial: PathBuf,
    target: PathBuf,
    sink: Sink,
    records: u64,
}

enum Sink {
    Jsonl(BufWriter<File>),
    Parquet(Box<ParquetSink>),
}

struct ParquetSink {
    file: Option<File>,
    /// Records held until the schema is known, then between batches.
    pending: Vec<String>,
    writer: Option<(ArrowWriter<File>, Decoder)>,
    /// Records written before `pending`, for error messages.
    written: u64,
}

impl OutputFile {
    /// Creates `<dir>/<name>.partial` (`name` with its extension).
    pub fn create(
        dir: &Path,
        name: &str,
        format: OutputFormat,
    ) -> Result<OutputFile, DatasetError> {
        let target = dir.join(name);
        let partial = dir.join(format!("{name}.partial"));
        let file = File::create(&partial).map_err(|e| DatasetError::io(&partial, e))?;
        let sink = match format {
            OutputFormat::Jsonl => Sink::Jsonl(BufWriter::with_capacity(1 << 16, file)),
            OutputFormat::Parquet => Sink::Parquet(Box::new(ParquetSink {
                file: Some(file),
                pending: Vec::new(),
                writer: None,
                written: 0,
            })),
        };
        Ok(OutputFile {
            name: name.to_owned(),
            partial,
            target,
            sink,
            records: 0,
        })
    }

    /// Reopens a JSONL file of an interrupted run at its last checkpoint:
    /// `<name>.partial` cut back to `bytes` (what was written after the
    /// checkpoint goes), to be appended to.
    pub fn resume(
        dir: &Path,
        name: &str,
        bytes: u64,
        records: u64,
    ) -> Result<OutputFile, DatasetError> {
        use std::io::{Seek, SeekFrom};
        let target = dir.join(name);
        let partial = dir.join(format!("{name}.partial"));
        let io = |e| DatasetError::io(&partial, e);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&partial)
            .map_err(io)?;
        if file.metadata().map_err(io)?.len() < bytes {
            return Err(DatasetError::io(
                &partial,
                std::io::Error::other("shorter than its checkpoint says"),
            ));
        }
        file.set_len(bytes).map_err(io)?;
        file.seek(SeekFrom::End(0)).map_err(io)?;
        Ok(OutputFile {
            name: name.to_owned(),
            partial,
            target,
            sink: Sink::Jsonl(BufWriter::with_capacity(1 << 16, file)),
            records,
        })
    }

    /// Makes what was written so far durable and says how long the file is
    /// (for a checkpoint); `None` for Parquet, which cannot be resumed.
    pub fn checkpoint(&mut self) -> Result<Option<u64>, DatasetError> {
        let Sink::Jsonl(w) = &mut self.sink else {
            return Ok(None);
        };
        let io = |e| DatasetError::io(&self.partial, e);
        w.flush().map_err(io)?;
        w.get_ref().sync_data().map_err(io)?;
        Ok(Some(w.get_ref().metadata().map_err(io)?.len()))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn records(&self) -> u64 {
        self.records
    }

    /// Appends one record (JSON text).
    pub fn write(&mut self, json: &str) -> Result<(), DatasetError> {
        self.records += 1;
        match &mut self.sink {
            Sink::Jsonl(w) => w
                .write_all(json.as_bytes())
                .and_then(|()| w.write_all(b"\n"))
                .map_err(|e| DatasetError::io(&self.partial, e)),
            Sink::Parquet(p) => {
                p.pending.push(json.to_owned());
                let ready = if p.writer.is_some() {
                    ROWS_PER_BATCH
                } else {
                    SCHEMA_SAMPLE
                };
                if p.pending.len() >= ready {
                    p.flush(&self.partial)?;
                }
                Ok(())
            }
        }
    }

    /// Flushes, syncs and renames the file to its final name.
    pub fn commit(self) -> Result<PathBuf, DatasetError> {
        let partial = self.partial.clone();
        let io = |e: std::io::Error| DatasetError::io(&partial, e);
        match self.sink {
            Sink::Jsonl(w) => {
                let file = w.into_inner().map_err(|e| io(e.into_error()))?;
                file.sync_data().map_err(io)?;
            }
            Sink::Parquet(mut p) => {
                p.flush(&partial)?;
                if let Some((writer, _)) = p.writer {
                    let file = writer
                        .into_inner()
                        .map_err(|e| DatasetError::io(&partial, std::io::Error::other(e)))?;
                    file.sync_data().map_err(io)?;
                } else {
                    // No record at all: a valid Parquet file with no columns.
                    let file = p
                        .file
                        .take()
                        .ok_or_else(|| io(std::io::Error::other("no file")))?;
                    let writer = ArrowWriter::try_new(file, Arc::new(Schema::empty()), None)
                        .map_err(|e| DatasetError::io(&partial, std::io::Error::other(e)))?;
                    writer
                        .close()
                        .map_err(|e| DatasetError::io(&partial, std::io::Error::other(e)))?;
                }
            }
        }
        std::fs::rename(&self.partial, &self.target)
            .map_err(|e| DatasetError::io(&self.target, e))?;
        Ok(self.target)
    }

    /// Removes the partial file (a failed or cancelled job).
    pub fn discard(self) {
        drop(self.sink);
        let _ = std::fs::remove_file(&self.partial);
    }
}

impl ParquetSink {
    /// Writes the pending records as one batch, inferring the schema from
    /// them first when it is not known yet.
    fn flush(&mut self, path: &Path) -> Result<(), DatasetError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let fail = |message: String| DatasetError::Output {
            file: path.to_owned(),
            message,
        };
        if self.writer.is_none() {
            let values = self.pending.iter().map(|r| {
                serde_json::from_str::<serde_json::Value>(r)
                    .map_err(|e| arrow_schema::ArrowError::JsonError(e.to_string()))
            });
            let schema = infer_json_schema_from_iterator(values).map_err(|e| {
                fail(format!(
                    "cannot infer a Parquet schema from the first records: {e}"
                ))
            })?;
            let schema = Arc::new(schema);
            let props = WriterProperties::builder()
                .set_compression(Compression::ZSTD(ZstdLevel::default()))
                .build();
            let file = self.file.take().ok_or_else(|| fail("no file".into()))?;
            let writer = ArrowWriter::try_new(file, schema.clone(), Some(props))
                .map_err(|e| fail(e.to_string()))?;
            // Room for every pending record: one flush writes them all.
            let decoder = ReaderBuilder::new(schema)
                .with_batch_size(SCHEMA_SAMPLE.max(ROWS_PER_BATCH) + 1)
                .with_strict_mode(true)
                .build_decoder()
                .map_err(|e| fail(e.to_string()))?;
            self.writer = Some((writer, decoder));
        }
        let Some((writer, decoder)) = self.writer.as_mut() else {
            return Ok(());
        };
        // Arrow checks types when the batch is built, so a misfit is known
        // for the batch, not the record.
        let (first, last) = (self.written + 1, self.written + self.pending.len() as u64);
        let misfit = |e: arrow_schema::ArrowError| {
            fail(format!(
                "a record among records {first}-{last} of this file does not fit the Parquet schema inferred from its first {SCHEMA_SAMPLE} records ({e}); write JSONL (\"output_format\": \"jsonl\") for records of varying shape"
            ))
        };
        for record in &self.pending {
            decoder.decode(record.as_bytes()).map_err(misfit)?;
            decoder.decode(b"\n").map_err(misfit)?;
        }
        if let Some(batch) = decoder.flush().map_err(misfit)? {
            writer.write(&batch).map_err(|e| fail(e.to_string()))?;
        }
        self.written += self.pending.len() as u64;
        self.pending.clear();
        Ok(())
    }
}
