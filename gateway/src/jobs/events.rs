//! Per-job NDJSON event logs: `<data_dir>/jobs/<id>.ndjson`, one
//! [`StoredEvent`] per line.
//!
//! Each line is built in memory and handed to the kernel in one `write`, so
//! a killed process leaves at most one torn final line, never an interleaved
//! one. Reopening a log (a queued job run again, a zombie's closing event)
//! first cuts such a torn tail, so that every line but possibly the last
//! being written always parses. Terminal events are also `fsync`ed.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use super::types::{JobEvent, StoredEvent};
use crate::util::time::unix_secs_f64;

/// The appending side of one job's log.
pub struct EventLog {
    path: PathBuf,
    inner: Mutex<Writer>,
}

struct Writer {
    file: Option<File>,
    next_seq: u64,
}

impl EventLog {
    /// Opens (creating) the log at `path`, cutting a torn final line and
    /// continuing the sequence after the last stored event.
    pub fn open(path: &Path) -> io::Result<EventLog> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        if keep < bytes.len() {
            file.set_len(keep as u64)?;
            file.seek(SeekFrom::End(0))?;
        }
        let last = parse_lines(&bytes[..keep]).last().map_or(0, |e| e.seq);
        Ok(EventLog {
            path: path.to_owned(),
            inner: Mutex::new(Writer {
                file: Some(file),
                next_seq: last + 1,
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `event` with the next sequence number and the current time.
    /// The sequence number is spent even if the write fails, so readers
    /// never see two events with one number.
    pub fn append(&self, event: JobEvent) -> io::Result<StoredEvent> {
        let mut w = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = StoredEvent {
            seq: w.next_seq,
            ts: unix_secs_f64(),
            event,
        };
        w.next_seq += 1;
        let mut line = serde_json::to_vec(&stored).map_err(io::Error::other)?;
        line.push(b'\n');
        let file = w
            .file
            .as_mut()
            .ok_or_else(|| io::Error::other("the log was closed after an error"))?;
        if let Err(e) = file.write_all(&line).and_then(|()| file.flush()) {
            // A partial write would leave a torn line in the middle; stop
            // writing rather than append after it.
            w.file = None;
            return Err(e);
        }
        if stored.event.is_terminal() {
            file.sync_data()?;
        }
        Ok(stored)
    }
}

/// Parses complete lines, skipping any that do not parse (a torn line).
fn parse_lines(bytes: &[u8]) -> Vec<StoredEvent> {
    bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect()
}

/// Reads a log incrementally: each call returns the complete lines written
/// since the last one; a line still being written waits for the next call.
pub struct LogReader {
    path: PathBuf,
    offset: u64,
}

impl LogReader {
    pub fn new(path: &Path) -> Self {
        LogReader {
            path: path.to_owned(),
            offset: 0,
        }
    }

    /// New complete events; none (not an error) if the log does not exist yet.
    pub fn read_new(&mut self) -> io::Result<Vec<StoredEvent>> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        file.seek(SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        self.offset += complete as u64;
        Ok(parse_lines(&bytes[..complete]))
    }
}

/// Every complete event in the log at `path`.
pub fn read_all(path: &Path) -> io::Result<Vec<StoredEvent>> {
    LogReader::new(path).read_new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_continue_after_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.ndjson");
        let log = EventLog::open(&path).unwrap();
        log.append(JobEvent::Started {}).unwrap();
        log.append(JobEvent::log("hello")).unwrap();
        drop(log);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"seq":3,"ts":1.0,"type":"lo"#).unwrap();
        drop(f);
        let mut reader = LogReader::new(&path);
        assert_eq!(reader.read_new().unwrap().len(), 2);

        let log = EventLog::open(&path).unwrap();
        let e = log.append(JobEvent::log("again")).unwrap();
        assert_eq!(e.seq, 3);
        let all = read_all(&path).unwrap();
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.lines()
                .all(|l| serde_json::from_str::<StoredEvent>(l).is_ok())
        );
        assert_eq!(reader.read_new().unwrap().len(), 1);
    }
}
