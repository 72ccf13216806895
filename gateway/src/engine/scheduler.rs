//! The engine thread: owns the model and every sequence's KV cache, and runs
//! continuous batching. Each step runs one decode step for all running
//! sequences as one batch, beside one chunk of the prompt being prefilled
//! (chunked prefill: at most `prefill_chunk` tokens while others decode, so
//! a long prompt arriving never stalls the running streams for its whole
//! prefill). Waiting requests start in weighted-fair order between tenants
//! ([`FairQueue`]) while the batch and KV memory allow; past the KV budget
//! the newest sequence is preempted (its cache dropped) and recomputed when
//! there is room again, its sampler and output state kept, so its stream
//! just pauses. A sequence whose client went away is dropped at the next
//! step, which frees its cache.
//!
//! Prompt caches plug in at both ends of a sequence: before prefill the
//! longest cached prefix (memory, or a file) replaces that part of the
//! prompt's prefill; after prefill and at the end, the sequence's cache is
//! offered to the in-memory tier (and, for long prompts in automatic mode,
//! written to a file in the background).
//!
//! A fault while working on one sequence fails that sequence's request
//! only: prefill, snapshots and mounts run under `catch_unwind`, and a
//! decode step that fails (an error or a panic) is retried one sequence at
//! a time from caches rolled back to before it, so the others go on and
//! the one at fault gets [`EngineError::Internal`]. The model keeps serving.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use mlx_rs::Array;
use tokio::sync::mpsc::UnboundedSender;

use std::collections::HashMap;

use super::admission::{Admission, SchedulingOptions, Ticket};
use super::api::{EngineError, FinishReason, GenerateEvent, SamplingParams, TokenOutput, Usage};
use super::constrain::Constraint;
use super::fair_queue::FairQueue;
use super::lora::{self, Adapter, AdapterInfo, AdapterStack};
use super::model::transformer::{Decoded, GreedyPick};
use super::model::{KvCache, Transformer};
use super::output::{Detokenizer, Filtered, StopFilter};
use super::prompt_cache::file::{LayerBytes, MappedFile};
use super::prompt_cache::memory::MemoryCache;
use super::prompt_cache::{
    CacheScope, CacheSource, CacheStats, CacheStore, Fingerprint, PromptCacheOptions,
    common_prefix, tensors,
};
use super::sampler::{Choice, Sampler};
use super::text::TextCodec;
use super::{Faults, guarded};

/// Longest slice of a prompt run through the model at once when nothing
/// else is running: bounds the attention scores' memory for long prompts.
const PREFILL_CHUNK: usize = 512;
/// Most short prompts prefilled together in one pass on a GPU.
const ARRIVALS_TOGETHER: usize = 32;

pub type EventSender = UnboundedSender<Result<GenerateEvent, EngineError>>;

/// What the engine thread is asked to do.
pub enum Command {
    Generate(Box<Job>),
    /// Prefill a prompt (reusing what is cached) and hand its cache back as
    /// bytes, for a named cache file.
    Snapshot {
        prompt: Vec<u32>,
        /// Whose cached prefixes the prefill may reuse, and who owns the result.
        scope: CacheScope,
        reply: tokio::sync::oneshot::Sender<Result<Vec<LayerBytes>, EngineError>>,
    },
    /// Load, check and keep an adapter (arrays live on this thread).
    Mount {
        id: String,
        path: std::path::PathBuf,
        reply: tokio::sync::oneshot::Sender<Result<AdapterInfo, EngineError>>,
    },
    /// Last-token embeddings of token ids (a chat model that embeds).
    Embed {
        inputs: Vec<Vec<u32>>,
        reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, EngineError>>,
    },
    /// Forget an adapter; sequences using it keep it until they end.
    Unmount {
        id: String,
        reply: tokio::sync::oneshot::Sender<bool>,
    },
}

/// A validated request, ready for the engine thread.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    /// A named cache file the request asked for, already checked.
    pub prompt_cache: Option<Arc<MappedFile>>,
    /// Mounted adapter ids to stack, in order.
    pub adapters: Vec<String>,
    /// Whose cached prefixes it may reuse; who owns what it caches.
    pub cache_scope: CacheScope,
    /// The compiled grammar the output must match, if any.
    pub constraint: Option<Constraint>,
    pub events: EventSender,
    /// More choices of the same prompt (`n` > 1): each continues from this
    /// job's prefill with its own sampler, grammar and events.
    pub forks: Vec<Fork>,
    /// Its place in the model's queue, given up when it starts.
    pub ticket: Ticket,
    /// Its class in the start order (higher first).
    pub priority: i8,
}

/// One more choice of a job's prompt.
pub struct Fork {
    pub seed: Option<u64>,
    pub constraint: Option<Constraint>,
    pub events: EventSender,
}

impl Job {
    /// Whether every choice's client has gone.
    fn abandoned(&self) -> bool {
        self.events.is_closed() && self.forks.iter().all(|f| f.events.is_closed())
    }

    /// Every choice's events, for failing them all.
    pub fn all_events(&self) -> Vec<EventSender> {
        std::iter::once(&self.events)
            .chain(self.forks.iter().map(|f| &f.events))
            .cloned()
            .collect()
    }
}

/// One running generation.
struct Sequence {
    cache: KvCache,
    adapters: AdapterStack,
    /// The adapter stack's key for prompt caches (`a+b`, or empty).
    adapters_key: String,
    /// The request's prompt-cache scope (its cache is offered under it).
    cache_scope: CacheScope,
    sampler: Sampler,
    detokenizer: Detokenizer,
    stop: StopFilter,
    events: EventSender,
    logprobs: Option<usize>,
    prompt_len: usize,
    /// Prompt tokens whose prefill a cache saved.
    cached_tokens: usize,
    /// The tokens `cache` covers (prompt, then fed-back outputs).
    history: Vec<u32>,
    generated: usize,
    max_new_tokens: usize,
    last_token: u32,
    /// An injected fault this sequence's decode steps hit (tests only).
    fault: Option<Fault>,
    /// The grammar its output must match, if any.
    constraint: Option<Constraint>,
    /// When its prefill began: a finished request's time in the engine
    /// (for `Retry-After` estimates).
    started: Instant,
}

impl Sequence {
    /// Another choice from this sequence's prefilled prompt: the same cache
    /// (shared storage, written past the prompt by each alone) and adapters,
    /// its own sampler (seeded `fork.seed`), grammar and events.
    fn fork(
        &self,
        fork: Fork,
        sampling: &SamplingParams,
        prompt: &[u32],
        stop: &[String],
    ) -> Sequence {
        let sampling = SamplingParams {
            seed: fork.seed,
            ..sampling.clone()
        };
        Sequence {
            cache: self.cache.clone(),
            adapters: self.adapters.clone(),
            adapters_key: self.adapters_key.clone(),
            cache_scope: self.cache_scope.clone(),
            sampler: Sampler::new(sampling, prompt),
            detokenizer: Detokenizer::new(),
            stop: StopFilter::new(stop.to_vec()),
            events: fork.events,
            logprobs: self.logprobs,
            prompt_len: self.prompt_len,
            cached_tokens: self.cached_tokens,
            history: self.history.clone(),
            generated: 0,
            max_new_tokens: self.max_new_tokens,
            last_token: 0,
            fault: self.fault,
            constraint: fork.constraint,
            started: self.started,
        }
    }
}

/// A fault injected into a sequence's decode steps ([`Faults`]).
#[derive(Debug, Clone, Copy)]
enum Fault {
    Panic,
    Error,
}

/// The error a request gets when its work failed (an error or a panic);
/// its text already says "generation failed".
fn generation_failed(why: &str) -> EngineError {
    EngineError::Internal(why.to_owned())
}

/// Ends a sequence's request with an internal error.
fn fail(seq: Sequence, why: &str) {
    let _ = seq.events.send(Err(generation_failed(why)));
}

/// Fails every choice of a request whose prefill failed; none goes on.
fn fail_prefill(prefill: &Prefill, why: &str) -> Option<Prefill> {
    fail_all(&prefill.all_events(), &generation_failed(why));
    None
}

/// Sends `error` to every choice of a request that cannot start.
fn fail_all(events: &[EventSender], error: &EngineError) {
    for e in events {
        let _ = e.send(Err(error.clone()));
    }
}

/// The engine thread's prompt-cache state.
pub struct Caching {
    pub options: PromptCacheOptions,
    pub fingerprint: Fingerprint,
    pub stats: Arc<CacheStats>,
}

pub struct Scheduler {
    model: Transformer,
    codec: Arc<TextCodec>,
    options: SchedulingOptions,
    /// The model's queue bound, shared with its handles.
    admission: Arc<Admission>,
    /// Requests received and not yet started, in fair order.
    waiting: FairQueue<Waiting>,
    /// Sequences preempted for KV memory, to recompute before new work.
    resuming: VecDeque<Sequence>,
    /// KV bytes one token takes in every layer.
    kv_bytes_per_token: usize,
    caching: Caching,
    memory: MemoryCache,
    /// Mounted adapters by id.
    adapters: HashMap<String, std::rc::Rc<Adapter>>,
    /// The model id adapters' recorded base models are checked against.
    model_id: String,
    faults: Faults,
    /// When the last decode step ended, while steps follow each other: the
    /// step log's `between_ms` (the loop's other work) is measured from it.
    last_step_end: Option<Instant>,
}

/// A request received and not yet started, with its adapters taken when it
/// arrived: one unmounted while it waits stays with it, as with a running
/// sequence.
struct Waiting {
    job: Job,
    adapters: AdapterStack,
}

/// A sequence whose prompt (or, resumed after preemption, whose history) is
/// being run into its cache, a chunk per engine step.
struct Prefill {
    seq: Sequence,
    /// Tokens of `seq.history` already in its cache.
    done: usize,
    /// For a new request: what its first token and its other choices need
    /// once the prompt is in. `None` for a resumed sequence, which goes on
    /// from its pending token.
    start: Option<Start>,
}

struct Start {
    sampling: SamplingParams,
    stop: Vec<String>,
    forks: Vec<Fork>,
}

impl Prefill {
    /// Whether every choice's client has gone.
    fn abandoned(&self) -> bool {
        self.seq.events.is_closed()
            && self
                .start
                .iter()
                .flat_map(|s| &s.forks)
                .all(|f| f.events.is_closed())
    }

    /// Every choice's events, for failing them all.
    fn all_events(&self) -> Vec<EventSender> {
        let forks = self
            .start
            .iter()
            .flat_map(|s| s.forks.iter().map(|f| &f.events));
        std::iter::once(&self.seq.events)
            .chain(forks)
            .cloned()
            .collect()
    }
}

impl Scheduler {
    pub fn new(
        model: Transformer,
        codec: Arc<TextCodec>,
        options: SchedulingOptions,
        admission: Arc<Admission>,
        mut caching: Caching,
    ) -> Scheduler {
        if model.is_split() {
            // The workers of a served group keep one copy of each cache:
            // prompt prefixes are neither kept nor saved to reuse.
            caching.options.memory_bytes = 0;
            caching.options.auto_save_min_tokens = None;
        }
        let memory = MemoryCache::new(caching.options.memory_bytes, Arc::clone(&caching.stats));
        let model_id = caching.fingerprint.model.clone();
        let config = &model.config;
        let kv_bytes_per_token =
            2 * config.layers * config.kv_heads * config.head_dim * std::mem::size_of::<f32>();
        Scheduler {
            model,
            codec,
            options: SchedulingOptions {
                max_batch: options.max_batch.max(1),
                prefill_chunk: options.prefill_chunk.max(1),
                ..options
            },
            admission,
            waiting: FairQueue::default(),
            resuming: VecDeque::new(),
            kv_bytes_per_token,
            caching,
            memory,
            adapters: HashMap::new(),
            model_id,
            faults: Faults::default(),
            last_step_end: None,
        }
    }

    /// Injects `faults` (debug builds only: tests of fault isolation).
    pub fn with_faults(mut self, faults: Faults) -> Scheduler {
        if cfg!(debug_assertions) {
            self.faults = faults;
        }
        self
    }

    fn mount(&mut self, id: &str, path: &std::path::Path) -> Result<AdapterInfo, EngineError> {
        if let Some(existing) = self.adapters.get(id) {
            if existing.info.path == path {
                return Ok(existing.info.clone());
            }
            return Err(EngineError::Adapter(format!(
                "an adapter `{id}` is already mounted from {}; unmount it first",
                existing.info.path.display()
            )));
        }
        let adapter = lora::load(id, path, &self.model_id, &self.model.lora_targets())
            .map_err(|e| EngineError::Adapter(e.to_string()))?;
        let info = adapter.info.clone();
        self.adapters
            .insert(id.to_owned(), std::rc::Rc::new(adapter));
        Ok(info)
    }

    /// The stack for `ids`, or why not (an id unmounted since validation).
    fn stack(&self, ids: &[String]) -> Result<AdapterStack, EngineError> {
        ids.iter()
            .map(|id| {
                self.adapters
                    .get(id)
                    .cloned()
                    .ok_or_else(|| EngineError::UnknownAdapter {
                        requested: id.clone(),
                        mounted: self.adapters.keys().cloned().collect(),
                    })
            })
            .collect()
    }

    /// Runs until every handle (sender of `jobs`) is gone and the work
    /// they sent is done.
    pub fn run(mut self, jobs: Receiver<Command>) {
        let mut running: Vec<Sequence> = Vec::new();
        let mut prefilling: Option<Prefill> = None;
        let mut open = true;
        let mut generating: Option<super::Generating> = None;
        loop {
            let idle = running.is_empty()
                && prefilling.is_none()
                && self.waiting.is_empty()
                && self.resuming.is_empty();
            if idle && !open {
                return;
            }
            if idle {
                generating = None;
                self.last_step_end = None;
            } else if generating.is_none() {
                generating = Some(super::Generating::start());
            }
            // Take in what was sent; sleep only when there is nothing to do.
            open = open && self.receive(&jobs, idle);
            if prefilling.is_none() {
                prefilling = self.next_prefill(&running);
                // On a GPU, short prompts waiting behind it go in with it.
                if let Some(first) = prefilling.take_if(|p| self.prefills_together(p)) {
                    prefilling = self.prefill_arrivals(first, &mut running);
                }
            }
            if let Some(prefill) = prefilling.take() {
                // Alone, a prompt goes in big chunks; beside running
                // streams, in small ones so their next tokens are not held up.
                let chunk = if running.is_empty() {
                    PREFILL_CHUNK.max(self.options.prefill_chunk)
                } else {
                    self.options.prefill_chunk
                };
                prefilling = self.prefill_step(prefill, chunk, &mut running);
            }
            running.retain(|seq| !seq.events.is_closed());
            // A request whose client left while it waited frees its place.
            self.waiting.retain(|waiting| !waiting.job.abandoned());
            self.preempt_over_budget(&mut running);
            if !running.is_empty() {
                self.step_isolated(&mut running);
            }
            crate::mlx::trim_gpu_buffer_cache();
            let sequences = running.len() + usize::from(prefilling.is_some());
            self.admission
                .publish_load(sequences, Scheduler::kv_in_use(&running));
        }
    }

    /// Handles the commands sent since the last step (blocking for the
    /// first when `idle`); false once every handle is gone.
    fn receive(&mut self, jobs: &Receiver<Command>, idle: bool) -> bool {
        let mut block = idle;
        loop {
            let next = if block {
                jobs.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                jobs.try_recv()
            };
            block = false;
            match next {
                Ok(Command::Generate(job)) => self.enqueue(*job),
                Ok(Command::Snapshot {
                    prompt,
                    scope,
                    reply,
                }) => {
                    let result = guarded(|| self.snapshot(&prompt, &scope));
                    let _ = reply.send(result.unwrap_or_else(|why| {
                        Err(EngineError::Internal(format!("snapshot failed: {why}")))
                    }));
                }
                Ok(Command::Mount { id, path, reply }) => {
                    let result = guarded(|| self.mount(&id, &path));
                    let _ = reply.send(result.unwrap_or_else(|why| {
                        Err(EngineError::Internal(format!("mount failed: {why}")))
                    }));
                }
                Ok(Command::Embed { inputs, reply }) => {
                    let result = guarded(|| self.embed_last_token(&inputs));
                    let _ =
                        reply.send(result.unwrap_or_else(Err).map_err(|why| {
                            EngineError::Internal(format!("embedding failed: {why}"))
                        }));
                }
                Ok(Command::Unmount { id, reply }) => {
                    let _ = reply.send(self.adapters.remove(&id).is_some());
                }
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Queues a received request in fair order, holding its adapters; one
    /// unmounted since it was validated fails it now.
    fn enqueue(&mut self, job: Job) {
        let adapters = match self.stack(&job.adapters) {
            Ok(stack) => stack,
            Err(error) => return fail_all(&job.all_events(), &error),
        };
        let tenant = job.ticket.tenant().map(str::to_owned);
        let weight = self.options.weight(tenant.as_deref());
        let priority = job.priority;
        self.waiting.push(
            priority,
            tenant.as_deref(),
            weight,
            Waiting { job, adapters },
        );
    }

    /// KV bytes held by `running`.
    fn kv_in_use(running: &[Sequence]) -> usize {
        running.iter().map(|seq| seq.cache.nbytes()).sum()
    }

    /// The next sequence to prefill, if the batch and the KV budget have
    /// room: a preempted one first, then a waiting request in fair order.
    /// With nothing running, one is always started.
    fn next_prefill(&mut self, running: &[Sequence]) -> Option<Prefill> {
        if running.len() >= self.options.max_batch {
            return None;
        }
        let in_use = Scheduler::kv_in_use(running);
        let (per_token, budget) = (self.kv_bytes_per_token, self.options.kv_cache_bytes);
        let fits = |tokens: usize| running.is_empty() || in_use + tokens * per_token <= budget;
        if let Some(seq) = self.resuming.front() {
            if !fits(seq.history.len()) {
                return None;
            }
            let mut seq = self.resuming.pop_front()?;
            seq.cache = self.model.new_cache();
            return Some(Prefill {
                seq,
                done: 0,
                start: None,
            });
        }
        while let Some(next) = self.waiting.peek() {
            if !fits(next.job.prompt.len()) {
                return None;
            }
            let waiting = self.waiting.pop()?;
            let everyone = waiting.job.all_events();
            match guarded(|| self.begin(waiting)) {
                Ok(Some(prefill)) => return Some(prefill),
                Ok(None) => continue,
                Err(why) => {
                    tracing::error!(error = %why, "prefill panicked; failing its request");
                    fail_all(&everyone, &generation_failed(&why));
                }
            }
        }
        None
    }

    /// One decode step for every running sequence. If it fails (an error or
    /// a panic) each cache is rolled back to before it and each sequence is
    /// stepped alone, so only the one at fault fails.
    fn step_isolated(&mut self, running: &mut Vec<Sequence>) {
        let why = match guarded(|| self.decode_step(running)) {
            Ok(Ok(())) => return,
            Ok(Err(error)) => error.what().to_owned(),
            Err(panic) => panic,
        };
        if running.len() == 1 {
            tracing::error!(error = %why, "decode step failed; failing its request");
            running.drain(..).for_each(|seq| fail(seq, &why));
            return;
        }
        tracing::warn!(
            error = %why,
            sequences = running.len(),
            "a batched decode step failed; stepping each sequence alone"
        );
        for mut seq in std::mem::take(running) {
            match seq.cache.rewound(seq.history.len()) {
                Some(cache) => seq.cache = cache,
                None => {
                    fail(seq, &format!("{why} (its cache cannot be rolled back)"));
                    continue;
                }
            }
            let mut alone = vec![seq];
            let why = match guarded(|| self.decode_step(&mut alone)) {
                Ok(Ok(())) => {
                    running.append(&mut alone);
                    continue;
                }
                Ok(Err(error)) => error.what().to_owned(),
                Err(panic) => panic,
            };
            tracing::error!(error = %why, "decode step failed; failing its request");
            alone.drain(..).for_each(|seq| fail(seq, &why));
        }
    }

    /// Starts a request from the longest cached prefix of its prompt; `None`
    /// when its clients are gone. Its place in the queue is given up here.
    fn begin(&mut self, waiting: Waiting) -> Option<Prefill> {
        let Waiting { job, adapters } = waiting;
        if job.abandoned() {
            return None;
        }
        let Job {
            prompt,
            sampling,
            stop,
            forks,
            ticket,
            ..
        } = job;
        drop(ticket);
        let adapters_key = lora::stack_key(&adapters);
        // At least the last prompt token runs: its logits start the reply.
        let limit = prompt.len() - 1;
        let (cache, cached_tokens) = self.reuse(
            &job.cache_scope,
            &prompt,
            limit,
            job.prompt_cache,
            &adapters_key,
        );
        if cfg!(debug_assertions)
            && let Some(marker) = self.faults.prefill_panic
            && prompt.contains(&marker)
        {
            panic!("injected prefill fault");
        }
        let seq = Sequence {
            cache,
            adapters,
            adapters_key,
            cache_scope: job.cache_scope,
            sampler: Sampler::new(sampling.clone(), &prompt),
            detokenizer: Detokenizer::new(),
            stop: StopFilter::new(stop.clone()),
            events: job.events,
            logprobs: job.logprobs,
            prompt_len: prompt.len(),
            cached_tokens,
            fault: self.fault_of(&prompt),
            history: prompt,
            generated: 0,
            max_new_tokens: job.max_new_tokens,
            last_token: 0,
            constraint: job.constraint,
            started: Instant::now(),
        };
        Some(Prefill {
            seq,
            done: cached_tokens,
            start: Some(Start {
                sampling,
                stop,
                forks,
            }),
        })
    }

    /// Runs the next chunk (at most `chunk` tokens) of `prefill`; once its
    /// history is all in, its sequences join `running` and `None` comes
    /// back. A failure (an error or a panic) fails its request only.
    fn prefill_step(
        &mut self,
        mut prefill: Prefill,
        chunk: usize,
        running: &mut Vec<Sequence>,
    ) -> Option<Prefill> {
        if prefill.abandoned() {
            return None;
        }
        let end = prefill.seq.history.len().min(prefill.done + chunk);
        let logits = if end > prefill.done {
            let seq = &mut prefill.seq;
            let tokens = &seq.history[prefill.done..end];
            match guarded(|| self.forward_chunk(tokens, &mut seq.cache, &seq.adapters)) {
                Ok(Ok(logits)) => Some(logits),
                Ok(Err(error)) => return fail_prefill(&prefill, error.what()),
                Err(why) => {
                    tracing::error!(error = %why, "prefill panicked; failing its request");
                    return fail_prefill(&prefill, &why);
                }
            }
        } else {
            None
        };
        prefill.done = end;
        if end < prefill.seq.history.len() {
            return Some(prefill);
        }
        let logits = logits.map(|logits| logits.as_slice::<f32>().to_vec());
        self.prefilled(prefill, logits.as_deref(), running);
        None
    }

    /// A prompt all in (`logits`: its last position's): its sequences join
    /// `running`.
    fn prefilled(&mut self, prefill: Prefill, logits: Option<&[f32]>, running: &mut Vec<Sequence>) {
        let everyone = prefill.all_events();
        let Prefill { seq, start, .. } = prefill;
        match (start, logits) {
            (Some(start), Some(logits)) => {
                match guarded(|| self.first_tokens(seq, start, logits)) {
                    Ok(seqs) => running.extend(seqs),
                    Err(why) => fail_all(&everyone, &generation_failed(&why)),
                }
            }
            // A resumed sequence goes on from its pending token.
            (None, _) => running.push(seq),
            (Some(_), None) => fail_all(
                &everyone,
                &generation_failed("the prompt produced no logits"),
            ),
        }
    }

    /// Whether `prefill` may go in one pass with other arrivals: on a GPU
    /// (where decode steps go through the slab), a prompt of at most
    /// [`PREFILL_CHUNK`] tokens still to run.
    fn prefills_together(&self, prefill: &Prefill) -> bool {
        let left = prefill.seq.history.len() - prefill.done;
        (1..=PREFILL_CHUNK).contains(&left) && self.model.decodes_in_slab(&[&prefill.seq.adapters])
    }

    /// Prefills `first` with the short prompts queued behind it (up to
    /// [`ARRIVALS_TOGETHER`], while the batch has room) in one pass over
    /// the weights: each arrival alone read them once per prompt, which at
    /// 128 streams took a third of the GPU's time. A longer prompt met on
    /// the way comes back, to be prefilled in chunks.
    fn prefill_arrivals(&mut self, first: Prefill, running: &mut Vec<Sequence>) -> Option<Prefill> {
        let mut batch = vec![first];
        let mut left_over = None;
        while batch.len() < ARRIVALS_TOGETHER
            && running.len() + batch.len() < self.options.max_batch
            && !self.waiting.is_empty()
        {
            match self.next_prefill(running) {
                Some(next) if self.prefills_together(&next) => batch.push(next),
                other => {
                    left_over = other;
                    break;
                }
            }
        }
        if batch.len() == 1 && left_over.is_none() {
            return batch.pop();
        }
        self.prefill_together(batch, running);
        left_over
    }

    /// Runs every prompt of `batch` into its cache in one forward pass;
    /// their sequences join `running`. If the pass fails, each is
    /// prefilled alone, so that only one at fault fails.
    fn prefill_together(&mut self, mut batch: Vec<Prefill>, running: &mut Vec<Sequence>) {
        batch.retain(|prefill| !prefill.abandoned());
        let started = Instant::now();
        let outcome = guarded(|| {
            let mut inputs: Vec<&[u32]> = Vec::with_capacity(batch.len());
            let mut caches: Vec<&mut KvCache> = Vec::with_capacity(batch.len());
            let mut stacks: Vec<&AdapterStack> = Vec::with_capacity(batch.len());
            for prefill in batch.iter_mut() {
                let seq = &mut prefill.seq;
                inputs.push(&seq.history[prefill.done..]);
                caches.push(&mut seq.cache);
                stacks.push(&seq.adapters);
            }
            let tokens: usize = inputs.iter().map(|t| t.len()).sum();
            let out = self
                .model
                .forward_with_adapters(&inputs, &mut caches, &stacks)?;
            mlx_rs::transforms::eval(
                std::iter::once(&out).chain(caches.iter().flat_map(|c| c.arrays())),
            )?;
            tracing::debug!(
                target: "mlxgate::engine::steps",
                sequences = inputs.len(),
                tokens,
                padded = inputs.len() * inputs.iter().map(|t| t.len()).max().unwrap_or(0),
                eval_ms = started.elapsed().as_secs_f64() * 1e3,
                "prefill together"
            );
            Ok::<_, mlx_rs::error::Exception>(out.as_slice::<f32>().to_vec())
        });
        let why = match outcome {
            Ok(Ok(logits)) => {
                let vocab = logits.len() / batch.len().max(1);
                for (row, mut prefill) in batch.into_iter().enumerate() {
                    prefill.done = prefill.seq.history.len();
                    let row = &logits[row * vocab..(row + 1) * vocab];
                    self.prefilled(prefill, Some(row), running);
                }
                return;
            }
            Ok(Err(error)) => error.what().to_owned(),
            Err(panic) => panic,
        };
        tracing::warn!(error = %why, prompts = batch.len(), "prefilling arrivals together failed; prefilling each alone");
        for mut prefill in batch {
            match prefill.seq.cache.rewound(prefill.done) {
                Some(cache) => prefill.seq.cache = cache,
                None => {
                    fail_prefill(&prefill, &why);
                    continue;
                }
            }
            let mut next = Some(prefill);
            while let Some(prefill) = next {
                next = self.prefill_step(prefill, PREFILL_CHUNK, running);
            }
        }
    }

    /// A new request's prompt is in: offer its cache to the memory tier,
    /// fork its other choices and emit each one's first token; returns those
    /// that go on. A request's choices start together, so `max_batch` may
    /// be passed by up to `n - 1` for a while.
    fn first_tokens(&mut self, seq: Sequence, start: Start, row: &[f32]) -> Vec<Sequence> {
        self.remember_prompt(
            &seq.cache_scope,
            &seq.history,
            &seq.cache,
            &seq.adapters_key,
        );
        let forks: Vec<Sequence> = start
            .forks
            .into_iter()
            .map(|fork| seq.fork(fork, &start.sampling, &seq.history, &start.stop))
            .collect();
        std::iter::once(seq)
            .chain(forks)
            .filter_map(|mut seq| self.accept(&mut seq, &mut row.to_vec()).then_some(seq))
            .collect()
    }

    /// Preempts the newest running sequences while their KV caches hold
    /// more than the budget (always leaving one): each drops its cache and
    /// waits to be recomputed, keeping everything else.
    fn preempt_over_budget(&mut self, running: &mut Vec<Sequence>) {
        let budget = self.options.kv_cache_bytes;
        // The step about to run adds a token to each.
        let next = |running: &[Sequence]| {
            Scheduler::kv_in_use(running) + running.len() * self.kv_bytes_per_token
        };
        while running.len() > 1 && next(running) > budget {
            let Some(mut seq) = running.pop() else { break };
            seq.cache = self.model.new_cache();
            tracing::info!(
                tokens = seq.history.len(),
                running = running.len(),
                "KV memory full: a sequence is preempted, to be recomputed"
            );
            self.admission
                .counters
                .preempted
                .fetch_add(1, Ordering::Relaxed);
            self.resuming.push_front(seq);
        }
    }

    /// The cache to start `prompt` from and how many of its tokens it covers
    /// (at most `limit`): the longest of the named file, the in-memory tier
    /// and, in automatic mode, the store's files; of the last two only what
    /// `scope` may reuse.
    fn reuse(
        &mut self,
        scope: &CacheScope,
        prompt: &[u32],
        limit: usize,
        named: Option<Arc<MappedFile>>,
        adapters: &str,
    ) -> (KvCache, usize) {
        let fingerprint = self.caching.fingerprint.with_adapters(adapters);
        let mut best: Option<(KvCache, usize, CacheSource)> = self
            .memory
            .lookup(scope, adapters, prompt, limit)
            .map(|r| (r.cache, r.tokens, CacheSource::Memory));
        let best_len =
            |best: &Option<(KvCache, usize, CacheSource)>| best.as_ref().map_or(0, |b| b.1);
        if let Some(file) = named {
            let shared = common_prefix(&file.info.header.tokens, prompt).min(limit);
            if shared > best_len(&best)
                && let Some(found) = self.import(file, shared)
            {
                best = Some((found.0, found.1, CacheSource::Disk));
            }
        }
        let auto = self.caching.options.auto_save_min_tokens.is_some();
        if let (true, Some(store)) = (auto, &self.caching.options.store)
            && let Some(found) = store.best_prefix(scope, &fingerprint, prompt, limit)
            && found.tokens > best_len(&best)
        {
            match CacheStore::open_file(&found.path, &fingerprint) {
                Ok(file) => {
                    if let Some(found) = self.import(Arc::new(file), found.tokens) {
                        best = Some((found.0, found.1, CacheSource::Disk));
                    }
                }
                Err(error) => tracing::warn!(%error, "prompt cache file skipped"),
            }
        }
        let stats = &self.caching.stats;
        match best {
            Some((cache, tokens, source)) => {
                stats.record(Some(source), tokens);
                (cache, tokens)
            }
            None => {
                stats.record(None, 0);
                (self.model.new_cache(), 0)
            }
        }
    }

    /// A mapped file's cache cut to the longest reusable prefix of `tokens`.
    fn import(&self, file: Arc<MappedFile>, tokens: usize) -> Option<(KvCache, usize)> {
        let path = file.info.header.name.clone();
        let imported = match tensors::import(file) {
            Ok(imported) => imported,
            Err(error) => {
                tracing::warn!(cache = %path, %error, "prompt cache file not usable");
                return None;
            }
        };
        tracing::debug!(cache = %path, zero_copy = imported.zero_copy, tokens, "prompt cache mapped");
        let tokens = imported.cache.reusable(tokens);
        if tokens == 0 {
            return None;
        }
        imported
            .cache
            .truncated(tokens)
            .ok()
            .map(|cache| (cache, tokens))
    }

    /// Offers a freshly prefilled prompt's cache to the memory tier and, in
    /// automatic mode, to a file written in the background, as `scope`'s
    /// tenant's.
    fn remember_prompt(
        &mut self,
        scope: &CacheScope,
        prompt: &[u32],
        cache: &KvCache,
        adapters: &str,
    ) {
        self.memory
            .insert(scope, adapters, prompt.to_vec(), cache.clone());
        let (Some(min), Some(store)) = (
            self.caching.options.auto_save_min_tokens,
            &self.caching.options.store,
        ) else {
            return;
        };
        let fingerprint = &self.caching.fingerprint.with_adapters(adapters);
        if prompt.len() < min || store.covers(scope, fingerprint, prompt) {
            return;
        }
        let layers = match tensors::export(cache) {
            Ok(layers) => layers,
            Err(error) => {
                tracing::warn!(%error, "cannot export a prompt cache");
                return;
            }
        };
        let (store, fingerprint, tokens) =
            (Arc::clone(store), fingerprint.clone(), prompt.to_vec());
        let owner = scope.tenant.clone();
        let stats = Arc::clone(&self.caching.stats);
        let spawned = std::thread::Builder::new().name("prompt-cache-save".into()).spawn(move || {
            let name = CacheStore::auto_name(&fingerprint, owner.as_deref(), &tokens);
            match store.save(&name, owner.as_deref(), &fingerprint, &tokens, &layers) {
                Ok(info) => {
                    stats.auto_saves.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(cache = %info.name, tokens = info.tokens, bytes = info.bytes, "prompt cache saved");
                }
                Err(error) => tracing::warn!(%error, "automatic prompt cache not saved"),
            }
        });
        if let Err(error) = spawned {
            tracing::warn!(%error, "cannot start the prompt cache writer");
        }
    }

    /// Last-token embeddings of `inputs`, one forward each (no cache).
    fn embed_last_token(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, String> {
        super::embed::last_token_embeddings(&self.model, inputs).map_err(|e| e.to_string())
    }

    /// Prefills all of `prompt` (reusing what `scope` may) and returns its
    /// cache as bytes.
    fn snapshot(
        &mut self,
        prompt: &[u32],
        scope: &CacheScope,
    ) -> Result<Vec<LayerBytes>, EngineError> {
        let internal = |e: mlx_rs::error::Exception| EngineError::Internal(e.to_string());
        let (mut cache, cached) = self.reuse(scope, prompt, prompt.len(), None, "");
        if cached < prompt.len() {
            self.prefill(&prompt[cached..], &mut cache, &AdapterStack::new())
                .map_err(internal)?;
        }
        self.remember_prompt(scope, prompt, &cache, "");
        tensors::export(&cache).map_err(internal)
    }

    /// Runs all of `prompt` into `cache` (in chunks), returning the last
    /// position's logits.
    fn prefill(
        &self,
        prompt: &[u32],
        cache: &mut KvCache,
        adapters: &AdapterStack,
    ) -> Result<Array, mlx_rs::error::Exception> {
        let mut logits = None;
        for chunk in prompt.chunks(PREFILL_CHUNK) {
            logits = Some(self.forward_chunk(chunk, cache, adapters)?);
        }
        logits.ok_or_else(|| mlx_rs::error::Exception::custom("empty prompt"))
    }

    /// Runs `tokens` into `cache`, evaluated: the last position's logits.
    fn forward_chunk(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        adapters: &AdapterStack,
    ) -> Result<Array, mlx_rs::error::Exception> {
        let started = Instant::now();
        let out = self
            .model
            .forward_with_adapters(&[tokens], &mut [&mut *cache], &[adapters])?;
        let built = started.elapsed();
        mlx_rs::transforms::eval(std::iter::once(&out).chain(cache.arrays()))?;
        tracing::debug!(
            target: "mlxgate::engine::steps",
            tokens = tokens.len(),
            cached = cache.offset - tokens.len(),
            build_ms = built.as_secs_f64() * 1e3,
            eval_ms = (started.elapsed() - built).as_secs_f64() * 1e3,
            "prefill chunk"
        );
        Ok(out)
    }

    /// The decode fault injected into a sequence with `prompt` (tests only).
    fn fault_of(&self, prompt: &[u32]) -> Option<Fault> {
        let marked = |marker: Option<u32>| marker.is_some_and(|m| prompt.contains(&m));
        if marked(self.faults.decode_panic) {
            Some(Fault::Panic)
        } else if marked(self.faults.decode_error) {
            Some(Fault::Error)
        } else {
            None
        }
    }

    /// One token for every running sequence, as one batch. On an error (or
    /// a panic) before the sequences are advanced, `running` is left as it
    /// was, its caches possibly one position into the step.
    fn decode_step(&mut self, running: &mut Vec<Sequence>) -> Result<(), mlx_rs::error::Exception> {
        if cfg!(debug_assertions) {
            match running.iter().find_map(|seq| seq.fault) {
                Some(Fault::Panic) => panic!("injected decode fault"),
                Some(Fault::Error) => {
                    return Err(mlx_rs::error::Exception::custom("injected decode fault"));
                }
                None => {}
            }
        }
        let started = Instant::now();
        let between = self.last_step_end.map(|end| started - end);
        let tokens: Vec<u32> = running.iter().map(|seq| seq.last_token).collect();
        // Where every row wants its most likely token, the device picks it.
        let greedy = running.iter().all(|seq| {
            seq.constraint.is_none() && seq.logprobs.is_none() && seq.sampler.is_plain_greedy()
        });
        let ban_rows: Vec<bool> = running.iter().map(|s| s.sampler.ignores_eos()).collect();
        let mut decoded = {
            let (stacks, mut caches): (Vec<&AdapterStack>, Vec<&mut KvCache>) = running
                .iter_mut()
                .map(|seq| (&seq.adapters, &mut seq.cache))
                .unzip();
            if greedy && self.model.decodes_in_slab(&stacks) {
                let pick = GreedyPick {
                    banned: &self.codec.eos_ids,
                    ban_rows: &ban_rows,
                };
                Decoded::Tokens(
                    self.model
                        .decode_greedy(&tokens, &mut caches, &stacks, &pick)?,
                )
            } else {
                Decoded::Logits(self.model.decode(&tokens, &mut caches, &stacks)?)
            }
        };
        let forwarded = started.elapsed();
        let rows = running.len();
        let mut keep = Vec::with_capacity(running.len());
        let mut finished = Vec::new();
        for (index, mut seq) in running.drain(..).enumerate() {
            if let Decoded::Tokens(picked) = &decoded
                && picked[index].is_none()
            {
                // It joined the step running ahead: its token comes next call.
                keep.push(seq);
                continue;
            }
            seq.history.push(seq.last_token);
            // Sampling and detokenizing are one sequence's own work.
            let accepted = match &mut decoded {
                Decoded::Logits(all) => {
                    let vocab = all.len() / rows;
                    let logits = &mut all[index * vocab..(index + 1) * vocab];
                    guarded(|| self.accept(&mut seq, logits))
                }
                Decoded::Tokens(picked) => guarded(|| {
                    let token = picked[index].expect("a row without a token was kept above");
                    let choice = seq.sampler.record(token);
                    self.advance(&mut seq, choice)
                }),
            };
            match accepted {
                Ok(true) => keep.push(seq),
                Ok(false) => finished.push(seq),
                Err(why) => {
                    tracing::error!(error = %why, "sampling panicked; failing its request");
                    fail(seq, &why);
                }
            }
        }
        *running = keep;
        let sampled = started.elapsed();
        let finishing = finished.len();
        // A finished conversation's cache serves its next turn.
        for seq in finished {
            self.memory
                .insert(&seq.cache_scope, &seq.adapters_key, seq.history, seq.cache);
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            target: "mlxgate::engine::steps",
            sequences = tokens.len(),
            between_ms = between.map(ms),
            forward_ms = ms(forwarded),
            sample_ms = ms(sampled - forwarded),
            finished = finishing,
            keep_finished_ms = ms(started.elapsed() - sampled),
            "decode step"
        );
        self.last_step_end = Some(Instant::now());
        Ok(())
    }

    /// Samples from `logits`, emits what is safe to show; false when finished.
    fn accept(&self, seq: &mut Sequence, logits: &mut [f32]) -> bool {
        if let Some(constraint) = seq.constraint.as_mut() {
            if let Err(error) = constraint.mask(logits) {
                let _ = seq.events.send(Err(EngineError::Internal(error)));
                return false;
            }
        } else if seq.sampler.ignores_eos() {
            for &id in &self.codec.eos_ids {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        let choice = seq.sampler.sample(logits, seq.logprobs);
        if let Some(constraint) = seq.constraint.as_mut()
            && !self.codec.eos_ids.contains(&choice.token)
            && let Err(error) = constraint.advance(choice.token)
        {
            let _ = seq.events.send(Err(EngineError::Internal(error)));
            return false;
        }
        self.advance(seq, choice)
    }

    /// Takes `choice` as `seq`'s next token: emits what is safe to show;
    /// false when finished.
    fn advance(&self, seq: &mut Sequence, choice: Choice) -> bool {
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
            Filtered::Stop(text, which) => {
                self.finish(seq, text, token, FinishReason::StopString(which))
            }
            Filtered::Continue(text) if seq.generated >= seq.max_new_tokens || context_full => {
                let text = text + &seq.stop.flush();
                self.finish(seq, text, token, FinishReason::Length)
            }
            Filtered::Continue(text) => {
                if !text.is_empty() || token.is_some() {
                    let delta = GenerateEvent::Delta {
                        text,
                        tokens: token.into_iter().collect(),
                        generated: seq.generated,
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
                generated: seq.generated,
            }));
        }
        let usage = Usage {
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated,
            cached_tokens: seq.cached_tokens,
        };
        self.admission.record_service(seq.started.elapsed());
        let _ = seq
            .events
            .send(Ok(GenerateEvent::Finished { reason, usage }));
        false
    }

    fn token_output(&self, choice: &Choice) -> TokenOutput {
        TokenOutput {
            id: choice.token,
            text: self.codec.token_text(choice.token),
            logprob: choice.logprob,
            top_logprobs: choice
                .top
                .iter()
                .map(|&(id, lp)| (self.codec.token_text(id), lp))
                .collect(),
        }
    }
}
