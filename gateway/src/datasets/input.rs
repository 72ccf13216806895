//! Where a dataset's records come from: one file, a folder of shards, or a
//! glob of them (`files/alpaca/train-*.parquet`), read shard after shard in
//! name order, each as a stream of JSON records in the order of its rows.
//! Memory stays bounded by one batch (and one Parquet row group's batch of
//! 1,024 rows) whatever the input's size.
//!
//! Formats, by file name: `.jsonl` / `.ndjson` (also `.gz` and `.zst`
//! compressed), `.csv` (with a header row) and `.parquet`. How each becomes
//! JSON:
//!
//! - JSONL: each non-empty line as it is (a line that is not JSON reaches
//!   the steps as it is, and a transform reports it).
//! - CSV: an object per row, keyed by the header, every value a string as
//!   written (no type guessing: `007` stays `"007"`; an empty field is `""`).
//!   A row with more or fewer fields than the header is an error naming the
//!   file and line.
//! - Parquet: an object per row, keyed by column name, through arrow-json:
//!   integers and floats as JSON numbers, booleans, strings, nulls as `null`
//!   (kept, not dropped), lists as arrays, structs as
//!   objects, timestamps and dates as ISO 8601 strings (`2023-11-14T22:13:20`,
//!   `2022-01-08`), decimals as JSON numbers (`123.45`), binary as a hex
//!   string (`"01ff"`); the test below pins each.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow_json::writer::{LineDelimited, WriterBuilder};
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};

use super::DatasetError;

/// The formats records are read from (and JSONL and Parquet written to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Jsonl,
    JsonlGz,
    JsonlZst,
    Csv,
    Parquet,
}

impl Format {
    /// The format a file's name says, if any.
    pub fn of(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let jsonl = |ext: &str| {
            [".jsonl", ".ndjson"]
                .iter()
                .any(|j| name.ends_with(&format!("{j}{ext}")))
        };
        Some(if jsonl("") {
            Format::Jsonl
        } else if jsonl(".gz") {
            Format::JsonlGz
        } else if jsonl(".zst") || jsonl(".zstd") {
            Format::JsonlZst
        } else if name.ends_with(".csv") {
            Format::Csv
        } else if name.ends_with(".parquet") {
            Format::Parquet
        } else {
            return None;
        })
    }
}

const FORMATS: &str = ".jsonl, .jsonl.gz, .jsonl.zst, .csv or .parquet";

/// One input file.
#[derive(Debug, Clone)]
pub struct Shard {
    pub path: PathBuf,
    pub format: Format,
    pub bytes: u64,
}

/// The shards `spec` names: a file, every file of a known format in a
/// folder, or the files a glob pattern matches; in name order.
pub fn resolve(spec: &Path) -> Result<Vec<Shard>, DatasetError> {
    let text = spec.to_string_lossy();
    let paths: Vec<PathBuf> = if text.contains(['*', '?', '[']) {
        let matches =
            glob::glob(&text).map_err(|e| DatasetError::NoInput(format!("{text}: {e}")))?;
        matches
            .filter_map(Result::ok)
            .filter(|p| p.is_file())
            .collect()
    } else if spec.is_dir() {
        let entries = std::fs::read_dir(spec).map_err(|e| DatasetError::io(spec, e))?;
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file() && Format::of(p).is_some())
            .collect()
    } else if spec.is_file() {
        vec![spec.to_owned()]
    } else {
        return Err(DatasetError::NoInput(format!(
            "{} does not exist",
            spec.display()
        )));
    };
    let mut shards = Vec::with_capacity(paths.len());
    for path in paths {
        let format = Format::of(&path).ok_or_else(|| {
            DatasetError::NoInput(format!("{}: not a {FORMATS} file", path.display()))
        })?;
        let bytes = path.metadata().map(|m| m.len()).unwrap_or(0);
        shards.push(Shard {
            path,
            format,
            bytes,
        });
    }
    shards.sort_by(|a, b| a.path.cmp(&b.path));
    if shards.is_empty() {
        return Err(DatasetError::NoInput(format!(
            "{}: no {FORMATS} file there",
            spec.display()
        )));
    }
    Ok(shards)
}

/// One record as read, with where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The record's JSON text.
    pub text: String,
    /// Index of its shard in the input's list.
    pub shard: usize,
    /// Its line (JSONL, CSV) or 1-based row (Parquet) in the shard.
    pub row: u64,
    /// Why it cannot be read as a record (invalid UTF-8), when `bad_records
    /// = "reject"` lets it through to the rejected file instead of failing.
    pub unreadable: Option<String>,
}

/// What to do with a record that cannot be read (invalid UTF-8 in JSONL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadRecords {
    /// Fail the job, naming the file and line (default).
    #[default]
    Fail,
    /// Write it to the rejected file with the reason and go on.
    Reject,
}

/// Reads the records of all shards in order, a batch at a time.
pub struct Reader {
    shards: Vec<Shard>,
    next_shard: usize,
    open: Option<(usize, Box<dyn ShardReader>)>,
    bad_records: BadRecords,
    /// Input bytes behind the records read so far (of compressed files, the
    /// compressed bytes), for progress.
    done_bytes: u64,
    /// Bytes of the shards finished before the open one.
    finished_bytes: u64,
}

impl Reader {
    pub fn new(shards: Vec<Shard>, bad_records: BadRecords) -> Reader {
        Reader {
            shards,
            next_shard: 0,
            open: None,
            bad_records,
            done_bytes: 0,
            finished_bytes: 0,
        }
    }

    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Total input bytes (what progress counts toward).
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes).sum()
    }

    /// Input bytes behind the records read so far.
    pub fn done_bytes(&self) -> u64 {
        self.done_bytes
    }

    /// Reads past the first `n` records (a resumed run's).
    pub fn skip(&mut self, mut n: u64) -> Result<(), DatasetError> {
        while n > 0 {
            let batch = self.next_batch(n.min(4096) as usize)?;
            if batch.is_empty() {
                break;
            }
            n -= batch.len() as u64;
        }
        Ok(())
    }

    /// Up to `n` records; an empty batch once every shard is read.
    pub fn next_batch(&mut self, n: usize) -> Result<Vec<Record>, DatasetError> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some((shard, reader)) = self.open.as_mut() else {
                if self.next_shard == self.shards.len() {
                    break;
                }
                let i = self.next_shard;
                self.next_shard += 1;
                self.open = Some((i, open_shard(&self.shards[i])?));
                continue;
            };
            let shard = *shard;
            match reader.next()? {
                Some((row, text)) => {
                    let (text, unreadable) = match text {
                        Ok(t) => (t, None),
                        Err(bytes) => {
                            let path = &self.shards[shard].path;
                            let why = not_utf8(&bytes);
                            if self.bad_records == BadRecords::Fail {
                                return Err(DatasetError::Record {
                                    file: path.clone(),
                                    row,
                                    message: format!(
                                        "{why} (set \"bad_records\": \"reject\" to write such records to the rejected file instead)"
                                    ),
                                });
                            }
                            (String::from_utf8_lossy(&bytes).into_owned(), Some(why))
                        }
                    };
                    out.push(Record {
                        text,
                        shard,
                        row,
                        unreadable,
                    });
                }
                None => {
                    self.finished_bytes += self.shards[shard].bytes;
                    self.open = None;
                }
            }
        }
        let within = self.open.as_ref().map_or(0, |(_, r)| r.position());
        self.done_bytes = self.finished_bytes + within;
        Ok(out)
    }
}

fn not_utf8(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(_) => "unreadable".into(),
        Err(e) => format!("not valid UTF-8 (at byte {})", e.valid_up_to()),
    }
}

/// A row: its line or row number and its text (or its bytes, when they
/// are not UTF-8).
type Row = (u64, Result<String, Vec<u8>>);

trait ShardReader: Send {
    fn next(&mut self) -> Result<Option<Row>, DatasetError>;
    /// Bytes of the file consumed so far.
    fn position(&self) -> u64;
}

fn open_shard(shard: &Shard) -> Result<Box<dyn ShardReader>, DatasetError> {
    let path = &shard.path;
    let file = File::open(path).map_err(|e| DatasetError::io(path, e))?;
    let counted = Counted::new(file);
    let position = counted.count.clone();
    let lines = |r: Box<dyn BufRead + Send>| -> Box<dyn ShardReader> {
        Box::new(Lines {
            path: path.clone(),
            reader: r,
            line: 0,
            buf: Vec::new(),
            position: position.clone(),
        })
    };
    Ok(match shard.format {
        Format::Jsonl => lines(Box::new(BufReader::with_capacity(1 << 16, counted))),
        Format::JsonlGz => lines(Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(
            BufReader::new(counted),
        )))),
        Format::JsonlZst => {
            let decoder =
                zstd::stream::read::Decoder::new(counted).map_err(|e| DatasetError::io(path, e))?;
            lines(Box::new(BufReader::new(decoder)))
        }
        Format::Csv => Box::new(CsvRows::new(path, counted)),
        Format::Parquet => Box::new(ParquetRows::open(path, shard.bytes)?),
    })
}

/// A reader that counts the bytes read through it.
struct Counted<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R> Counted<R> {
    fn new(inner: R) -> Self {
        Counted {
            inner,
            count: Arc::default(),
        }
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// JSONL: non-empty lines.
struct Lines {
    path: PathBuf,
    reader: Box<dyn BufRead + Send>,
    line: u64,
    buf: Vec<u8>,
    position: Arc<AtomicU64>,
}

impl ShardReader for Lines {
    fn next(&mut self) -> Result<Option<Row>, DatasetError> {
        loop {
            self.buf.clear();
            let n =
                self.reader
                    .read_until(b'\n', &mut self.buf)
                    .map_err(|e| DatasetError::Record {
                        file: self.path.clone(),
                        row: self.line + 1,
                        message: format!("cannot read: {e}"),
                    })?;
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            while matches!(self.buf.last(), Some(b'\n' | b'\r')) {
                self.buf.pop();
            }
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let bytes = std::mem::take(&mut self.buf);
            return Ok(Some((
                self.line,
                String::from_utf8(bytes).map_err(|e| e.into_bytes()),
            )));
        }
    }

    fn position(&self) -> u64 {
        self.position.load(Ordering::Relaxed)
    }
}

/// CSV with a header row: each row an object of strings.
struct CsvRows {
    path: PathBuf,
    reader: csv::Reader<Counted<File>>,
    headers: Option<Vec<String>>,
    record: csv::ByteRecord,
    position: Arc<AtomicU64>,
}

impl CsvRows {
    fn new(path: &Path, file: Counted<File>) -> Self {
        let position = file.count.clone();
        CsvRows {
            path: path.to_owned(),
            reader: csv::ReaderBuilder::new().flexible(false).from_reader(file),
            headers: None,
            record: csv::ByteRecord::new(),
            position,
        }
    }

    fn error(path: &Path, e: &csv::Error) -> DatasetError {
        let row = e.position().map_or(0, csv::Position::line);
        let message = match e.kind() {
            csv::ErrorKind::UnequalLengths {
                expected_len, len, ..
            } => format!("{len} fields where the header has {expected_len}"),
            _ => e.to_string(),
        };
        DatasetError::Record {
            file: path.to_owned(),
            row,
            message,
        }
    }
}

impl ShardReader for CsvRows {
    fn next(&mut self) -> Result<Option<Row>, DatasetError> {
        if self.headers.is_none() {
            let path = &self.path;
            let headers = self
                .reader
                .byte_headers()
                .map_err(|e| Self::error(path, &e))?;
            let names = headers
                .iter()
                .map(|h| String::from_utf8_lossy(h).into_owned())
                .collect();
            self.headers = Some(names);
        }
        let more = self
            .reader
            .read_byte_record(&mut self.record)
            .map_err(|e| Self::error(&self.path, &e))?;
        if !more {
            return Ok(None);
        }
        let line = self.record.position().map_or(0, csv::Position::line);
        let headers = self.headers.as_deref().unwrap_or_default();
        let mut object = serde_json::Map::with_capacity(headers.len());
        for (name, field) in headers.iter().zip(self.record.iter()) {
            match std::str::from_utf8(field) {
                Ok(v) => object.insert(name.clone(), v.into()),
                Err(_) => return Ok(Some((line, Err(self.record.as_slice().to_vec())))),
            };
        }
        Ok(Some((
            line,
            Ok(serde_json::Value::Object(object).to_string()),
        )))
    }

    fn position(&self) -> u64 {
        self.position.load(Ordering::Relaxed)
    }
}

/// Parquet: record batches of 1,024 rows turned into JSON lines by
/// arrow-json.
struct ParquetRows {
    path: PathBuf,
    batches: ParquetRecordBatchReader,
    lines: std::vec::IntoIter<String>,
    row: u64,
    rows: u64,
    bytes: u64,
}

impl ParquetRows {
    fn open(path: &Path, bytes: u64) -> Result<Self, DatasetError> {
        let file = File::open(path).map_err(|e| DatasetError::io(path, e))?;
        let corrupt = |e: parquet::errors::ParquetError| DatasetError::Record {
            file: path.to_owned(),
            row: 0,
            message: format!("not a readable Parquet file: {e}"),
        };
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(corrupt)?;
        let rows = u64::try_from(builder.metadata().file_metadata().num_rows()).unwrap_or(0);
        let batches = builder.with_batch_size(1024).build().map_err(corrupt)?;
        Ok(ParquetRows {
            path: path.to_owned(),
            batches,
            lines: Vec::new().into_iter(),
            row: 0,
            rows,
            bytes,
        })
    }
}

impl ShardReader for ParquetRows {
    fn next(&mut self) -> Result<Option<Row>, DatasetError> {
        loop {
            if let Some(line) = self.lines.next() {
                self.row += 1;
                return Ok(Some((self.row, Ok(line))));
            }
            let Some(batch) = self.batches.next() else {
                return Ok(None);
            };
            let fail = |message: String| DatasetError::Record {
                file: self.path.clone(),
                row: self.row + 1,
                message,
            };
            let batch = batch.map_err(|e| fail(format!("cannot read: {e}")))?;
            let mut writer = WriterBuilder::new()
                .with_explicit_nulls(true)
                .build::<_, LineDelimited>(Vec::new());
            writer
                .write(&batch)
                .and_then(|()| writer.finish())
                .map_err(|e| fail(format!("cannot convert to JSON: {e}")))?;
            let text = String::from_utf8(writer.into_inner())
                .map_err(|e| fail(format!("not UTF-8 after conversion: {e}")))?;
            self.lines = text
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
                .into_iter();
        }
    }

    fn position(&self) -> u64 {
        (self.bytes as f64 * self.row as f64 / self.rows.max(1) as f64) as u64
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{Int64Builder, ListBuilder};
    use arrow_array::{
        ArrayRef, BinaryArray, BooleanArray, Date32Array, Decimal128Array, Float64Array,
        RecordBatch, StringArray, StructArray, TimestampMillisecondArray,
    };
    use arrow_schema::{DataType, Field};
    use parquet::arrow::ArrowWriter;

    use super::*;

    /// The Arrow-to-JSON mapping the module docs (and the README) promise.
    #[test]
    fn parquet_rows_become_json_as_documented() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        let mut list = ListBuilder::new(Int64Builder::new());
        list.values().append_value(1);
        list.values().append_value(2);
        list.append(true);
        list.append(false);
        let inner = Arc::new(StringArray::from(vec![Some("x"), None])) as ArrayRef;
        let columns: Vec<(&str, ArrayRef)> = vec![
            (
                "int",
                Arc::new(arrow_array::Int32Array::from(vec![Some(7), None])),
            ),
            ("float", Arc::new(Float64Array::from(vec![1.5, 2.0]))),
            ("bool", Arc::new(BooleanArray::from(vec![true, false]))),
            ("text", Arc::new(StringArray::from(vec![Some("é"), None]))),
            (
                "bytes",
                Arc::new(BinaryArray::from(vec![&b"\x01\xff"[..], &b""[..]])),
            ),
            (
                "dec",
                Arc::new(
                    Decimal128Array::from(vec![12345, -5])
                        .with_precision_and_scale(10, 2)
                        .unwrap(),
                ),
            ),
            ("date", Arc::new(Date32Array::from(vec![19000, 0]))),
            (
                "ts",
                Arc::new(TimestampMillisecondArray::from(vec![1_700_000_000_000, 0])),
            ),
            ("list", Arc::new(list.finish())),
            (
                "obj",
                Arc::new(StructArray::from(vec![(
                    Arc::new(Field::new("a", DataType::Utf8, true)),
                    inner,
                )])),
            ),
        ];
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let mut w =
            ArrowWriter::try_new(File::create(&path).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let shards = resolve(&path).unwrap();
        let rows = Reader::new(shards, BadRecords::Fail)
            .next_batch(10)
            .unwrap();
        let got: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| serde_json::from_str(&r.text).unwrap())
            .collect();
        eprintln!("{}", serde_json::to_string_pretty(&got).unwrap());
        assert_eq!(got[0]["int"], 7);
        assert_eq!(got[1]["int"], serde_json::Value::Null, "nulls are kept");
        assert_eq!(got[0]["float"], 1.5);
        assert_eq!(got[0]["bool"], true);
        assert_eq!(got[0]["text"], "é");
        assert_eq!(got[0]["list"], serde_json::json!([1, 2]));
        assert_eq!(got[0]["obj"], serde_json::json!({"a": "x"}));
        assert_eq!(got[0]["bytes"], "01ff", "binary as hex");
        assert_eq!(got[0]["dec"], 123.45, "decimals as numbers");
        assert_eq!(got[0]["date"], "2022-01-08");
        assert_eq!(got[0]["ts"], "2023-11-14T22:13:20");
    }
}
