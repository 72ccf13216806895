//! Dataset cleaning: normalises whitespace in every string of a JSON record and
//! drops empty, oversized and non-UTF-8 records.
//!
//! Whitespace: CRLF becomes LF, runs of spaces and tabs become one space,
//! lines are trimmed, more than one blank line collapses to one, and the
//! string is trimmed. A record is "empty" when all its strings are empty after
//! that, "oversized" when its strings total more than `max_chars` (default
//! 32768), and "non-utf8" when it holds U+FFFD (the host's replacement for
//! undecodable bytes) or an unpaired surrogate escape. Config:
//! `{"max_chars": 8192}`.

use mlxgate_guest::dataset::*;
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetClean {
    #[serde(default = "default_max")]
    max_chars: usize,
}

fn default_max() -> usize {
    32 * 1024
}

/// Normalises one string as described in the crate docs.
fn normalise(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut blank_run = 0;
    for line in s.replace("\r\n", "\n").split('\n') {
        let line = line
            .split([' ', '\t'])
            .filter(|w| !w.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        if line.is_empty() {
            blank_run += 1;
            continue;
        }
        if !out.is_empty() {
            out.push_str(if blank_run > 0 { "\n\n" } else { "\n" });
        }
        blank_run = 0;
        out.push_str(&line);
    }
    out
}

/// Whether the text holds a `\uD800`-`\uDFFF` escape: on a parse failure
/// that means an unpaired surrogate, i.e. text that was never valid UTF-8.
fn has_surrogate_escape(text: &str) -> bool {
    text.as_bytes().windows(4).any(|w| {
        w[0] == b'\\'
            && w[1] == b'u'
            && w[2].eq_ignore_ascii_case(&b'd')
            && matches!(w[3].to_ascii_lowercase(), b'8'..=b'9' | b'a'..=b'f')
    })
}

/// Normalises every string in `v`, returning (total chars, saw U+FFFD).
fn clean(v: &mut Value) -> (usize, bool) {
    match v {
        Value::String(s) => {
            let bad = s.contains('\u{FFFD}');
            *s = normalise(s);
            (s.chars().count(), bad)
        }
        Value::Array(items) => items
            .iter_mut()
            .map(clean)
            .fold((0, false), |a, b| (a.0 + b.0, a.1 || b.1)),
        Value::Object(map) => map
            .values_mut()
            .map(clean)
            .fold((0, false), |a, b| (a.0 + b.0, a.1 || b.1)),
        _ => (0, false),
    }
}

impl DatasetTransform for DatasetClean {
    fn init(config: &str) -> Result<Self, String> {
        let config = if config.trim().is_empty() {
            "{}"
        } else {
            config
        };
        serde_json::from_str(config).map_err(|e| format!("dataset-clean config: {e}"))
    }

    fn transform_record(&self, record: &str) -> RecordOutcome {
        if record.contains('\u{FFFD}') {
            return RecordOutcome::Drop("non-utf8".to_string());
        }
        let mut value: Value = match serde_json::from_str(record) {
            Ok(v) => v,
            Err(_) if has_surrogate_escape(record) => {
                return RecordOutcome::Drop("non-utf8".to_string());
            }
            Err(e) => return RecordOutcome::Error(format!("invalid JSON: {e}")),
        };
        let (chars, bad) = clean(&mut value);
        if bad {
            RecordOutcome::Drop("non-utf8".to_string())
        } else if chars == 0 {
            RecordOutcome::Drop("empty".to_string())
        } else if chars > self.max_chars {
            RecordOutcome::Drop(format!("oversized: {chars} chars > {}", self.max_chars))
        } else {
            RecordOutcome::Keep(value.to_string())
        }
    }
}

mlxgate_guest::export_dataset_transform!(DatasetClean);
