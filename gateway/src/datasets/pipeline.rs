//! A dataset pipeline: steps applied to each record in order, a record
//! dropped (or failed) by one step going no further.
//!
//! Steps, as written in a job's `steps` list:
//!
//! - `{"policy": "NAME"}`: a dataset-transform Wasm policy (with the config
//!   it was uploaded with).
//! - `{"dedupe": ["field", ...]}`: drops a record whose chosen fields (all of
//!   it with `[]`) are exactly those of an earlier record: a 128-bit hash of
//!   their JSON is kept per distinct record (16 bytes in a hash set: with
//!   its control bytes and spare capacity, between about 19 and 37 bytes a
//!   record; an estimate from the layout, not measured).
//! - `{"filter_length": {"model": PATH, "min_tokens": N, "max_tokens": M}}`:
//!   keeps records whose token count, as a fine-tune would tokenize them
//!   with that model's tokenizer (`messages` through its chat template,
//!   `prompt` + `completion`, or `text`), lies within [N, M]; a record
//!   fine-tuning could not read is an error.
//!
//! The steps before the first `dedupe` run on a pool of threads, a batch
//! of records each (each thread calls the policy host, which keeps a warm
//! guest instance per concurrent call); their results are put back in input
//! order, and the rest of the pipeline (from the first `dedupe` on, which
//! must see records in order to keep the first of each duplicate) runs on
//! one thread. Output order is input order, whatever the pool's size.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Mutex, PoisonError};

use serde_json::Value;

use crate::engine::text::TextCodec;
use crate::engine::train::encode_record;
use crate::policy::{PolicyHost, RecordOutcome};

/// One step, ready to run.
pub enum Step {
    Transform(String),
    Dedupe(Vec<String>),
    FilterLength {
        codec: Arc<TextCodec>,
        min_tokens: u64,
        max_tokens: u64,
    },
}

impl Step {
    /// The step's name in rejected records and previews.
    pub fn label(&self) -> String {
        match self {
            Step::Transform(name) => format!("policy {name}"),
            Step::Dedupe(_) => "dedupe".into(),
            Step::FilterLength { .. } => "filter_length".into(),
        }
    }

    fn is_stateful(&self) -> bool {
        matches!(self, Step::Dedupe(_))
    }
}

/// What became of one record.
#[derive(Debug, Clone, PartialEq)]
pub enum Fate {
    Keep(String),
    /// Left out on purpose by step `step` (its index), with the reason.
    Drop {
        step: usize,
        reason: String,
    },
    /// Invalid, or the step failed on it.
    Error {
        step: usize,
        reason: String,
    },
}

/// An error that stops the whole pipeline (not one record's).
#[derive(Debug, thiserror::Error)]
#[error("step {step} ({label}): {message}")]
pub struct StepFailed {
    pub step: usize,
    pub label: String,
    pub message: String,
}

/// The steps and what they run on.
pub struct Pipeline {
    steps: Vec<Step>,
    host: Option<Arc<PolicyHost>>,
    /// Index of the first step that must see records in order.
    serial_from: usize,
}

impl Pipeline {
    /// `host` is needed when any step is a policy.
    pub fn new(steps: Vec<Step>, host: Option<Arc<PolicyHost>>) -> Pipeline {
        let serial_from = steps
            .iter()
            .position(Step::is_stateful)
            .unwrap_or(steps.len());
        Pipeline {
            steps,
            host,
            serial_from,
        }
    }

    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Runs the whole pipeline over one batch with fresh state (a preview).
    pub fn run_once(&self, records: Vec<String>) -> Result<Vec<Fate>, StepFailed> {
        let fates = self.apply(0..self.serial_from, records, &mut Dedupers::default())?;
        self.finish(fates, &mut Dedupers::default())
    }

    /// Runs `batches` (numbered from 0, in order) through the pipeline on
    /// `workers` threads and hands each batch's fates to `sink` in input
    /// order, on the calling thread, with the pipeline's state after it
    /// (to checkpoint). Stops at the first error of either.
    pub fn run_parallel<E: From<StepFailed> + Send>(
        &self,
        workers: usize,
        state: &mut PipelineState,
        mut next_batch: impl FnMut() -> Result<Option<Vec<String>>, E>,
        mut sink: impl FnMut(Vec<Fate>, &PipelineState) -> Result<(), E>,
    ) -> Result<(), E> {
        let workers = workers.max(1);
        // Bounded queues: at most a few batches per worker wait on either
        // side, so memory stays bounded by the batch size.
        let (work_tx, work_rx) = sync_channel::<(u64, Vec<String>)>(workers * 2);
        let (done_tx, done_rx) = sync_channel::<Done>(workers * 2);
        let work_rx = Mutex::new(work_rx);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                let (rx, tx) = (&work_rx, done_tx.clone());
                scope.spawn(move || self.worker(rx, tx));
            }
            drop(done_tx);
            let mut feeder = Feeder(Some(work_tx));
            let result = self.drive(
                (&mut feeder, &done_rx),
                state,
                &mut next_batch,
                &mut sink,
                workers,
            );
            // Dropping the sender ends the workers; drain what they still send.
            feeder.0 = None;
            while done_rx.recv().is_ok() {}
            result
        })
    }

    fn worker(&self, rx: &Mutex<Receiver<(u64, Vec<String>)>>, tx: SyncSender<Done>) {
        loop {
            let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
            let Ok((seq, records)) = job else { return };
            let fates = self.apply(0..self.serial_from, records, &mut Dedupers::default());
            if tx.send((seq, fates)).is_err() {
                return;
            }
        }
    }

    /// Keeps the workers fed, reorders their results and runs the serial
    /// part.
    fn drive<E: From<StepFailed>>(
        &self,
        (feeder, done): (&mut Feeder, &Receiver<Done>),
        state: &mut PipelineState,
        next_batch: &mut impl FnMut() -> Result<Option<Vec<String>>, E>,
        sink: &mut impl FnMut(Vec<Fate>, &PipelineState) -> Result<(), E>,
        workers: usize,
    ) -> Result<(), E> {
        let mut waiting: BTreeMap<u64, Vec<Fate>> = BTreeMap::new();
        let (mut sent, mut handed) = (0u64, 0u64);
        let mut input_done = false;
        loop {
            // Keep up to two batches per worker in flight.
            while !input_done && sent - handed < (workers * 2) as u64 {
                match next_batch()? {
                    Some(batch) if !batch.is_empty() => {
                        feeder.send(sent, batch);
                        sent += 1;
                    }
                    _ => input_done = true,
                }
            }
            if handed == sent {
                return Ok(());
            }
            let Ok((seq, fates)) = done.recv() else {
                return Ok(());
            };
            waiting.insert(seq, fates?);
            while let Some(fates) = waiting.remove(&handed) {
                let fates = self.finish(fates, &mut state.dedupers)?;
                sink(fates, state)?;
                handed += 1;
            }
        }
    }

    /// The serial part of the pipeline over a batch's fates so far.
    fn finish(&self, fates: Vec<Fate>, dedupers: &mut Dedupers) -> Result<Vec<Fate>, StepFailed> {
        if self.serial_from == self.steps.len() {
            return Ok(fates);
        }
        let mut out = fates;
        let kept: Vec<(usize, String)> = out
            .iter_mut()
            .enumerate()
            .filter_map(|(i, f)| match f {
                Fate::Keep(text) => Some((i, std::mem::take(text))),
                _ => None,
            })
            .collect();
        let (slots, records): (Vec<usize>, Vec<String>) = kept.into_iter().unzip();
        let later = self.apply(self.serial_from..self.steps.len(), records, dedupers)?;
        for (slot, fate) in slots.into_iter().zip(later) {
            out[slot] = fate;
        }
        Ok(out)
    }

    /// Steps `range` over `records`, each record's fate in order.
    fn apply(
        &self,
        range: std::ops::Range<usize>,
        records: Vec<String>,
        dedupers: &mut Dedupers,
    ) -> Result<Vec<Fate>, StepFailed> {
        let mut fates: Vec<Fate> = records.into_iter().map(Fate::Keep).collect();
        for i in range {
            let step = &self.steps[i];
            let alive: Vec<usize> = (0..fates.len())
                .filter(|&j| matches!(fates[j], Fate::Keep(_)))
                .collect();
            if alive.is_empty() {
                break;
            }
            let inputs: Vec<String> = alive
                .iter()
                .map(|&j| match &mut fates[j] {
                    Fate::Keep(t) => std::mem::take(t),
                    _ => String::new(),
                })
                .collect();
            let results = self.step(i, step, inputs, dedupers)?;
            for (j, fate) in alive.into_iter().zip(results) {
                fates[j] = fate;
            }
        }
        Ok(fates)
    }

    fn step(
        &self,
        i: usize,
        step: &Step,
        records: Vec<String>,
        dedupers: &mut Dedupers,
    ) -> Result<Vec<Fate>, StepFailed> {
        let failed = |message: String| StepFailed {
            step: i,
            label: step.label(),
            message,
        };
        Ok(match step {
            Step::Transform(name) => {
                let host = self
                    .host
                    .as_ref()
                    .ok_or_else(|| failed("no policy host".into()))?;
                let outcomes = host
                    .transform_batch(name, &records)
                    .map_err(|e| failed(e.to_string()))?;
                if outcomes.len() != records.len() {
                    return Err(failed(format!(
                        "{} outcomes for {} records",
                        outcomes.len(),
                        records.len()
                    )));
                }
                outcomes
                    .into_iter()
                    .map(|o| match o {
                        RecordOutcome::Keep(text) => match one_line_json(text) {
                            Ok(text) => Fate::Keep(text),
                            Err(reason) => Fate::Error { step: i, reason },
                        },
                        RecordOutcome::Drop(reason) => Fate::Drop { step: i, reason },
                        RecordOutcome::Error(reason) => Fate::Error { step: i, reason },
                    })
                    .collect()
            }
            Step::Dedupe(fields) => {
                let seen = dedupers.0.entry(i).or_default();
                records
                    .into_iter()
                    .map(|text| match dedupe_key(&text, fields) {
                        Err(reason) => Fate::Error { step: i, reason },
                        Ok(key) if seen.insert(key) => Fate::Keep(text),
                        Ok(_) => Fate::Drop {
                            step: i,
                            reason: "duplicate of an earlier record".into(),
                        },
                    })
                    .collect()
            }
            Step::FilterLength {
                codec,
                min_tokens,
                max_tokens,
            } => records
                .into_iter()
                .map(|text| {
                    let tokens = serde_json::from_str::<Value>(&text)
                        .map_err(|e| format!("not JSON: {e}"))
                        .and_then(|v| encode_record(codec, &v, false))
                        .map(|example| example.tokens.len() as u64);
                    match tokens {
                        Err(reason) => Fate::Error { step: i, reason },
                        Ok(n) if n < *min_tokens || n > *max_tokens => Fate::Drop {
                            step: i,
                            reason: format!("{n} tokens, outside {min_tokens}..={max_tokens}"),
                        },
                        Ok(_) => Fate::Keep(text),
                    }
                })
                .collect(),
        })
    }
}

/// A batch's number and its fates after the parallel steps.
type Done = (u64, Result<Vec<Fate>, StepFailed>);

/// Sends numbered batches to the workers; `None` once they are to stop.
struct Feeder(Option<SyncSender<(u64, Vec<String>)>>);

impl Feeder {
    fn send(&self, seq: u64, batch: Vec<String>) {
        if let Some(tx) = &self.0 {
            let _ = tx.send((seq, batch));
        }
    }
}

/// The hashes each `dedupe` step has seen, by step index.
#[derive(Default, Debug, PartialEq)]
struct Dedupers(BTreeMap<usize, HashSet<u128>>);

/// What a pipeline remembers between batches (the records each `dedupe`
/// step has seen), saved with a run's checkpoint so a resumed run drops
/// the same duplicates an uninterrupted one would.
#[derive(Default, Debug, PartialEq)]
pub struct PipelineState {
    dedupers: Dedupers,
}

impl PipelineState {
    /// As bytes: per step its index, count and hashes (little-endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (step, seen) in &self.dedupers.0 {
            out.extend_from_slice(&(*step as u64).to_le_bytes());
            out.extend_from_slice(&(seen.len() as u64).to_le_bytes());
            for h in seen {
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        out
    }

    pub fn from_bytes(mut b: &[u8]) -> Option<PipelineState> {
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, rest) = b.split_at_checked(n)?;
            b = rest;
            Some(head)
        };
        let mut state = PipelineState::default();
        while let Some(step) = take(8) {
            let step = u64::from_le_bytes(step.try_into().ok()?) as usize;
            let count = u64::from_le_bytes(take(8)?.try_into().ok()?) as usize;
            let mut seen = HashSet::with_capacity(count);
            for _ in 0..count {
                seen.insert(u128::from_le_bytes(take(16)?.try_into().ok()?));
            }
            state.dedupers.0.insert(step, seen);
        }
        Some(state)
    }
}

/// A guest's kept record as one line of JSON: it must be one JSON document
/// (checked here, so a bad one is blamed on the step that made it), and a
/// pretty-printed one loses its line breaks, which valid JSON can only have
/// between tokens, so JSONL output and shuffle buckets stay one record a
/// line.
fn one_line_json(text: String) -> Result<String, String> {
    serde_json::from_str::<serde::de::IgnoredAny>(&text)
        .map_err(|e| format!("kept record is not one JSON document: {e}"))?;
    if text.contains(['\n', '\r']) {
        return Ok(text.replace(['\n', '\r'], ""));
    }
    Ok(text)
}

/// The 128-bit hash of a record's chosen fields (their JSON, in the order
/// given; a missing field counts as null), or of its whole text.
fn dedupe_key(text: &str, fields: &[String]) -> Result<u128, String> {
    if fields.is_empty() {
        return Ok(xxhash_rust::xxh3::xxh3_128(text.as_bytes()));
    }
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let chosen: Vec<&Value> = fields
        .iter()
        .map(|f| v.get(f).unwrap_or(&Value::Null))
        .collect();
    let key = serde_json::to_string(&chosen).map_err(|e| e.to_string())?;
    Ok(xxhash_rust::xxh3::xxh3_128(key.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_records_become_one_line_of_json() {
        let pretty = "{\n  \"text\": \"a\\nb\",\r\n  \"n\": [1,\n 2]\n}\n".to_string();
        assert_eq!(
            one_line_json(pretty).unwrap(),
            r#"{  "text": "a\nb",  "n": [1, 2]}"#
        );
        let plain = r#"{"a":1}"#.to_string();
        assert_eq!(one_line_json(plain.clone()).unwrap(), plain);
        for bad in ["{\"a\":", "{} {}", "", "not json"] {
            let err = one_line_json(bad.to_string()).unwrap_err();
            assert!(err.contains("not one JSON document"), "{bad}: {err}");
        }
    }

    fn lines(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("{{\"q\": \"{}\", \"i\": {i}}}", i % 7))
            .collect()
    }

    #[test]
    fn dedupe_keeps_the_first_of_each_and_order_holds_on_any_pool() {
        let p = Pipeline::new(vec![Step::Dedupe(vec!["q".into()])], None);
        let all = lines(100);
        let once = p.run_once(all.clone()).unwrap();
        let kept: Vec<&Fate> = once.iter().filter(|f| matches!(f, Fate::Keep(_))).collect();
        assert_eq!(kept.len(), 7);
        assert_eq!(once[0], Fate::Keep(all[0].clone()));
        assert!(matches!(once[7], Fate::Drop { step: 0, .. }));
        for workers in [1, 3, 8] {
            let mut batches = all.chunks(9).map(<[String]>::to_vec);
            let mut out = Vec::new();
            let mut state = PipelineState::default();
            p.run_parallel::<StepFailed>(
                workers,
                &mut state,
                || Ok(batches.next()),
                |fates, _| {
                    out.extend(fates);
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(out, once, "{workers} workers");
            let saved = PipelineState::from_bytes(&state.to_bytes()).unwrap();
            assert_eq!(saved, state);
            assert_eq!(saved.dedupers.0[&0].len(), 7);
        }
    }

    #[test]
    fn whole_record_dedupe_and_bad_json() {
        assert_eq!(dedupe_key("{\"a\":1}", &[]), dedupe_key("{\"a\":1}", &[]));
        assert_ne!(dedupe_key("{\"a\":1}", &[]), dedupe_key("{\"a\": 1}", &[]));
        assert!(dedupe_key("nope", &["a".into()]).is_err());
        let missing = dedupe_key("{\"b\":1}", &["a".into()]).unwrap();
        assert_eq!(missing, dedupe_key("{\"a\":null}", &["a".into()]).unwrap());
    }
}
