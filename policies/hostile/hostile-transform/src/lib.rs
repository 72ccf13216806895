//! A hostile dataset transform for containment tests, never shipped. Records:
//! `"spin"` loops forever (fuel must stop it), `"oom"` exhausts memory,
//! `"short"` makes the whole batch answer one outcome too few; anything else
//! is kept unchanged.

use std::hint::black_box;

use mlxgate_guest::dataset::*;

struct HostileTransform;

impl DatasetTransform for HostileTransform {
    fn init(_config: &str) -> Result<Self, String> {
        Ok(HostileTransform)
    }

    fn transform_record(&self, record: &str) -> RecordOutcome {
        match record {
            "\"spin\"" => {
                let mut n: u64 = 0;
                loop {
                    n = black_box(n.wrapping_add(1));
                }
            }
            "\"oom\"" => {
                let mut v: Vec<Vec<u8>> = Vec::new();
                loop {
                    let mut chunk = Vec::with_capacity(4 << 20);
                    chunk.push(1u8);
                    v.push(black_box(chunk));
                }
            }
            other => RecordOutcome::Keep(other.to_string()),
        }
    }

    fn transform(&self, records: Vec<String>) -> Vec<RecordOutcome> {
        let short = records.iter().any(|r| r == "\"short\"");
        let mut out: Vec<RecordOutcome> =
            records.iter().map(|r| self.transform_record(r)).collect();
        if short {
            out.pop();
        }
        out
    }
}

mlxgate_guest::export_dataset_transform!(HostileTransform);
