//! JSONL input for dataset transforms, read in batches: one guest call per
//! batch amortises the call cost. Shared by the dataset job and the
//! `mlxgate dataset transform` CLI.

use std::io::{self, BufRead};

/// Non-empty records of one batch with their 1-based line numbers.
pub struct Batch {
    pub records: Vec<String>,
    pub lines: Vec<u64>,
}

/// Reads non-empty lines (line endings trimmed, invalid UTF-8 shown lossily)
/// in batches of up to `size`.
pub struct JsonlBatches<R> {
    reader: R,
    size: usize,
    line_no: u64,
    consumed: u64,
    buf: Vec<u8>,
}

impl<R: BufRead> JsonlBatches<R> {
    pub fn new(reader: R, size: usize) -> Self {
        JsonlBatches {
            reader,
            size: size.max(1),
            line_no: 0,
            consumed: 0,
            buf: Vec::new(),
        }
    }

    /// Bytes read so far (for progress against the file size).
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// The next batch; `None` once the input is exhausted.
    pub fn next_batch(&mut self) -> io::Result<Option<Batch>> {
        let mut batch = Batch {
            records: Vec::with_capacity(self.size),
            lines: Vec::with_capacity(self.size),
        };
        while batch.records.len() < self.size {
            self.buf.clear();
            let n = self.reader.read_until(b'\n', &mut self.buf)?;
            if n == 0 {
                break;
            }
            self.consumed += n as u64;
            self.line_no += 1;
            let text = String::from_utf8_lossy(&self.buf);
            let text = text.trim_end_matches(['\n', '\r']);
            if !text.trim().is_empty() {
                batch.records.push(text.to_owned());
                batch.lines.push(self.line_no);
            }
        }
        Ok((!batch.records.is_empty()).then_some(batch))
    }
}

#[cfg(test)]
mod tests {
    use super::JsonlBatches;

    #[test]
    fn batches_skip_blank_lines_and_keep_line_numbers() {
        let input = "{\"a\":1}\r\n\n  \n{\"b\":2}\n{\"c\":3}";
        let mut batches = JsonlBatches::new(input.as_bytes(), 2);
        let first = batches.next_batch().unwrap().unwrap();
        assert_eq!(first.records, ["{\"a\":1}", "{\"b\":2}"]);
        assert_eq!(first.lines, [1, 4]);
        let second = batches.next_batch().unwrap().unwrap();
        assert_eq!(
            (second.records.as_slice(), second.lines.as_slice()),
            (&["{\"c\":3}".to_owned()][..], &[5][..])
        );
        assert!(batches.next_batch().unwrap().is_none());
        assert_eq!(batches.consumed(), input.len() as u64);
    }
}
