//! The engine thread: owns the model and every sequence's KV cache, and runs
//! continuous batching. Between decode steps it admits queued requests
//! (prefilling each), then runs one decode step for all running sequences as
//! one batch. A sequence whose client went away is dropped at the next step,
//! which frees its cache.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};

use mlx_rs::Array;
use tokio::sync::mpsc::UnboundedSender;

use super::api::{EngineError, FinishReason, GenerateEvent, SamplingParams, TokenOutput, Usage};
use super::model::{KvCache, Transformer};
use super::output::{Detokenizer, Filtered, StopFilter};
use super::sampler::{Choice, Sampler};
use super::text::TextCodec;

/// Longest slice of a prompt run through the model at once: bounds the
/// attention scores' memory for long prompts.
const PREFILL_CHUNK: usize = 512;

pub type EventSender = UnboundedSender<Result<GenerateEvent, EngineError>>;

/// A validated request, ready for the engine thread.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    pub events: EventSender,
}

/// One running generation.
struct Sequence {
    cache: KvCache,
    sampler: Sampler,
    detokenizer: Detokenizer,
    stop: StopFilter,
    events: EventSender,
    logprobs: Option<usize>,
    prompt_len: usize,
    generated: usize,
    max_new_tokens: usize,
    last_token: u32,
}

pub struct Scheduler {
    model: Transformer,
    codec: Arc<TextCodec>,
    max_batch: usize,
    /// Requests sent but not yet admitted (shared with the handles).
    queued: Arc<AtomicUsize>,
}

impl Scheduler {
    pub fn new(
        model: Transformer,
        codec: Arc<TextCodec>,
        max_batch: usize,
        queued: Arc<AtomicUsize>,
    ) -> Scheduler {
        Scheduler {
            model,
            codec,
            max_batch: max_batch.max(1),
            queued,
        }
    }

    /// Runs until every handle (sender of `jobs`) is gone.
    pub fn run(self, jobs: Receiver<Job>) {
        let mut running: Vec<Sequence> = Vec::new();
        loop {
            // Admit new work between steps; sleep only when idle.
            while running.len() < self.max_batch {
                let next = if running.is_empty() {
                    jobs.recv().map_err(|_| TryRecvError::Disconnected)
                } else {
                    jobs.try_recv()
                };
                match next {
                    Ok(job) => running.extend(self.start(job)),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if running.is_empty() {
                            return;
                        }
                        break;
                    }
                }
            }
            running.retain(|seq| !seq.events.is_closed());
            if running.is_empty() {
                continue;
            }
            if let Err(error) = self.decode_step(&mut running) {
                let error = EngineError::Internal(error.to_string());
                for seq in running.drain(..) {
                    let _ = seq.events.send(Err(error.clone()));
                }
            }
        }
    }

    /// Prefills a new request and emits its first token; returns it if it goes on.
    fn start(&self, job: Job) -> Option<Sequence> {
        self.queued.fetch_sub(1, Ordering::Relaxed);
        if job.events.is_closed() {
            return None;
        }
        let mut seq = Sequence {
            cache: self.model.new_cache(),
            sampler: Sampler::new(job.sampling, &job.prompt),
            detokenizer: Detokenizer::new(),
            stop: StopFilter::new(job.stop),
            events: job.events,
            logprobs: job.logprobs,
            prompt_len: job.prompt.len(),
            generated: 0,
            max_new_tokens: job.max_new_tokens,
            last_token: 0,
        };
        let logits = match self.prefill(&job.prompt, &mut seq.cache) {
            Ok(logits) => logits,
            Err(error) => {
                let _ = seq
                    .events
                    .send(Err(EngineError::Internal(error.to_string())));
                return None;
            }
        };
        let mut row = logits.as_slice::<f32>().to_vec();
        self.accept(&mut seq, &mut row).then_some(seq)
    }

    fn prefill(
        &self,
        prompt: &[u32],
        cache: &mut KvCache,
    ) -> Result<Array, mlx_rs::error::Exception> {
        let mut logits = None;
        for chunk in prompt.chunks(PREFILL_CHUNK) {
            let out = self.model.forward(&[chunk], &mut [&mut *cache])?;
            mlx_rs::transforms::eval(std::iter::once(&out).chain(cache.arrays()))?;
            logits = Some(out);
        }
        logits.ok_or_else(|| mlx_rs::error::Exception::custom("empty prompt"))
    }

    /// One token for every running sequence, as one batch.
    fn decode_step(&self, running: &mut Vec<Sequence>) -> Result<(), mlx_rs::error::Exception> {
        let inputs: Vec<[u32; 1]> = running.iter().map(|seq| [seq.last_token]).collect();
        let tokens: Vec<&[u32]> = inputs.iter().map(|t| t.as_slice()).collect();
        let logits = {
            let mut caches: Vec<&mut KvCache> =
                running.iter_mut().map(|seq| &mut seq.cache).collect();
            let logits = self.model.forward(&tokens, &mut caches)?;
            mlx_rs::transforms::eval(
                std::iter::once(&logits).chain(caches.iter().flat_map(|c| c.arrays())),
            )?;
            logits
        };
        let vocab = logits.shape()[1] as usize;
        let all = logits.as_slice::<f32>();
        let mut keep = Vec::with_capacity(running.len());
        for (index, mut seq) in running.drain(..).enumerate() {
            let mut row = all[index * vocab..(index + 1) * vocab].to_vec();
            if self.accept(&mut seq, &mut row) {
                keep.push(seq);
            }
        }
        *running = keep;
        Ok(())
    }

    /// Samples from `logits`, emits what is safe to show; false when finished.
    fn accept(&self, seq: &mut Sequence, logits: &mut [f32]) -> bool {
        let choice = seq.sampler.sample(logits, seq.logprobs.unwrap_or(0));
        seq.generated += 1;
        seq.last_token = choice.token;
        let context_full = seq.prompt_len + seq.generated >= self.model.config.context_length;
        let token = seq.logprobs.map(|_| self.token_output(&choice));
        if self.codec.eos_ids.contains(&choice.token) {
            // The end-of-sequence token is not content: no text, no logprob
            // entry, not counted in usage (as mlx-lm's server counts).
            seq.generated -= 1;
            let rest = seq.stop.flush();
            return self.finish(seq, rest, None, FinishReason::Stop);
        }
        let text = seq
            .detokenizer
            .push(choice.token, |ids| self.codec.decode(ids));
        match seq.stop.feed(&text) {
            Filtered::Stop(text) => self.finish(seq, text, token, FinishReason::Stop),
            Filtered::Continue(text) if seq.generated >= seq.max_new_tokens || context_full => {
                let text = text + &seq.stop.flush();
                self.finish(seq, text, token, FinishReason::Length)
            }
            Filtered::Continue(text) => {
                if !text.is_empty() || token.is_some() {
                    let delta = GenerateEvent::Delta {
                        text,
                        tokens: token.into_iter().collect(),
                    };
                    if seq.events.send(Ok(delta)).is_err() {
                        return false;
                    }
                }
                true
            }
        }
    }

    fn finish(
        &self,
        seq: &Sequence,
        text: String,
        token: Option<TokenOutput>,
        reason: FinishReason,
    ) -> bool {
        if !text.is_empty() || token.is_some() {
            let _ = seq.events.send(Ok(GenerateEvent::Delta {
                text,
                tokens: token.into_iter().collect(),
            }));
        }
        let usage = Usage {
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated,
        };
        let _ = seq
            .events
            .send(Ok(GenerateEvent::Finished { reason, usage }));
        false
    }

    fn token_output(&self, choice: &Choice) -> TokenOutput {
        TokenOutput {
            id: choice.token,
            text: self.codec.token_text(choice.token),
            logprob: Some(choice.logprob),
            top_logprobs: choice
                .top
                .iter()
                .map(|&(id, lp)| (self.codec.token_text(id), lp))
                .collect(),
        }
    }
}
