//! The inference engine: model files loaded through MLX, tokenizer and chat
//! template, sampling, and a scheduler thread per model doing continuous
//! batching. Knows nothing of HTTP; its API ([`api`]) has no MLX types.

mod admission;
use admission::Admission;
pub use admission::{QueueStats, SchedulingOptions};
pub mod api;
mod constrain;
mod fair_queue;
use constrain::Constraint;
pub mod convert;
pub mod distributed;
mod doctor;
pub mod embed;
pub mod lora;
pub mod model;
mod output;
pub mod prompt_cache;
mod sampler;
mod scheduler;
pub mod text;
pub mod tools;
pub mod train;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

pub use api::*;
pub use doctor::doctor_report;
pub use model::LoadError;
use model::Transformer;
use prompt_cache::{
    CacheInfo, CacheScope, CacheStats, CacheStatsSnapshot, CacheStore, Fingerprint,
    PromptCacheOptions, SaveError,
};
pub use sampler::argmax;
use scheduler::{Caching, Command, Fork, Job, Scheduler};
use text::TextCodec;

use crate::mlx::distributed::DistGroup;
use crate::mlx::kernels::{self, KernelChoice};

/// Runs `work`, turning a panic into an error message: a fault in one
/// request's work on an engine thread fails that request, not the thread.
fn guarded<T>(work: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
        .map_err(|p| crate::util::panic_message(&*p))
}

/// Chat engines with work in hand (prefilling or decoding), process-wide:
/// the embeddings thread gives way to them (see [`embed`]).
static GENERATING: AtomicUsize = AtomicUsize::new(0);

/// Whether some chat engine is generating now.
pub(crate) fn chat_is_generating() -> bool {
    GENERATING.load(Ordering::Relaxed) > 0
}

/// Counts its engine in [`GENERATING`] while alive.
struct Generating;

impl Generating {
    fn start() -> Generating {
        GENERATING.fetch_add(1, Ordering::Relaxed);
        Generating
    }
}

impl Drop for Generating {
    fn drop(&mut self) {
        GENERATING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// In-memory prompt cache of an engine loaded without options.
const DEFAULT_MEMORY_CACHE_BYTES: usize = 256 * 1024 * 1024;

/// How an engine runs, besides its model file.
#[derive(Clone)]
pub struct EngineOptions {
    pub prompt_cache: PromptCacheOptions,
    /// Which quantized matmul the engine thread runs (native CPU kernels or
    /// MLX's own); see [`crate::mlx::kernels`].
    pub kernels: KernelChoice,
    /// Batch, queue and KV memory bounds, fairness between tenants.
    pub scheduling: SchedulingOptions,
    /// Faults to inject, for tests of fault isolation (debug builds only;
    /// release builds ignore them).
    #[doc(hidden)]
    pub faults: Faults,
}

/// Faults a debug build injects into sequences whose prompt holds a marker
/// token, to show that one failing sequence fails its own request only.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Panic while prefilling a prompt that holds this token.
    pub prefill_panic: Option<u32>,
    /// Panic in any decode step whose batch has such a sequence.
    pub decode_panic: Option<u32>,
    /// Fail (an MLX error) any decode step whose batch has such a sequence.
    pub decode_error: Option<u32>,
}

impl Faults {
    /// From `prefill_panic=7,decode_error=9` (a test's environment).
    pub fn parse(spec: &str) -> Result<Faults, String> {
        let mut faults = Faults::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, token) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}`: expected name=token"))?;
            let token = token
                .parse()
                .map_err(|_| format!("`{part}`: the token must be a number"))?;
            let slot = match name {
                "prefill_panic" => &mut faults.prefill_panic,
                "decode_panic" => &mut faults.decode_panic,
                "decode_error" => &mut faults.decode_error,
                _ => return Err(format!("`{name}`: no such fault")),
            };
            *slot = Some(token);
        }
        Ok(faults)
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            prompt_cache: PromptCacheOptions {
                memory_bytes: DEFAULT_MEMORY_CACHE_BYTES,
                store: None,
                auto_save_min_tokens: None,
            },
            kernels: KernelChoice::default_for_process(),
            scheduling: SchedulingOptions::default(),
            faults: Faults::default(),
        }
    }
}

/// A running model. Cheap to clone; the engine thread stops when the last
/// handle is dropped and its work is done.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

struct Inner {
    card: ModelCard,
    /// Generations whose stream is alive (queued or running).
    in_flight: Arc<AtomicUsize>,
    /// Requests sent to the engine thread and not yet started, bounded.
    admission: Arc<Admission>,
    codec: Arc<TextCodec>,
    /// What this engine's prompt caches depend on.
    fingerprint: Fingerprint,
    cache_stats: Arc<CacheStats>,
    store: Option<Arc<CacheStore>>,
    /// Mounted adapters, as the engine thread last reported them.
    adapters: std::sync::RwLock<std::collections::BTreeMap<String, lora::AdapterInfo>>,
    /// `None` once the engine is shutting down.
    jobs: Mutex<Option<Sender<Command>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Inner {
    /// The last handle is gone: close the queue and wait for the engine thread
    /// to finish what is running, so MLX is never torn down (process exit)
    /// under a thread that is still computing.
    fn drop(&mut self) {
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.take();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A model in memory, before its thread starts.
pub struct LoadedModel {
    pub transformer: Transformer,
    pub codec: TextCodec,
    pub id: String,
}

impl LoadedModel {
    /// Loads a `.gguf` file or an HF / mlx-community directory. Blocking.
    /// This process's part of the model at `path`, split over `group`: a
    /// GGUF file cut tensor by tensor as it is read, a safetensors
    /// directory (read lazily) cut block by block.
    pub fn load_shard(path: &Path, group: &DistGroup) -> Result<LoadedModel, LoadError> {
        if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
            let file = model::GgufReader::open(path)
                .map_err(|e| LoadError::Io(path.to_owned(), e.to_string()))?;
            let transformer = model::load_gguf_shard(path, &file, group.rank(), group.size())?;
            let codec = TextCodec::for_gguf_file(path, &file)?;
            return Ok(LoadedModel {
                transformer,
                codec,
                id: model::model_id(path),
            });
        }
        let mut model = LoadedModel::load(path)?;
        model.transformer = model.transformer.sharded(group)?;
        Ok(model)
    }

    pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
        let id = model::model_id(path);
        if path.is_dir() && path.join("config.json").is_file() {
            let transformer = model::load_hf_dir(path)?;
            let codec = TextCodec::from_hf_dir(path, &[])?;
            return Ok(LoadedModel {
                transformer,
                codec,
                id,
            });
        }
        if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
            let file = model::GgufReader::open(path)
                .map_err(|e| LoadError::Io(path.to_owned(), e.to_string()))?;
            let transformer = model::load_gguf(path, &file)?;
            let codec = TextCodec::for_gguf_file(path, &file)?;
            return Ok(LoadedModel {
                transformer,
                codec,
                id,
            });
        }
        if !path.exists() {
            return Err(LoadError::Io(
                path.to_owned(),
                "not found (run scripts/setup.sh for the default model)".into(),
            ));
        }
        Err(LoadError::UnknownFormat(path.to_owned()))
    }
}

/// The tokenizer (and chat template) of the model at `path` (a `.gguf` file
/// or an HF / mlx-community directory) without its weights, for counting
/// tokens as the model would. Blocking.
pub fn load_text_codec(path: &Path) -> Result<TextCodec, LoadError> {
    if path.is_dir() && path.join("config.json").is_file() {
        return TextCodec::from_hf_dir(path, &[]);
    }
    if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        let file = model::GgufReader::open(path)
            .map_err(|e| LoadError::Io(path.to_owned(), e.to_string()))?;
        return TextCodec::for_gguf_file(path, &file);
    }
    Err(LoadError::UnknownFormat(path.to_owned()))
}

/// How long rank 0 of a served group waits for its workers at start.
const GROUP_FORM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Loads the model at `path` on the calling (engine) thread with every
/// weight evaluated and the native decode step's weights built, so the
/// first request pays for neither.
fn load_for_serving(path: &Path) -> Result<LoadedModel, LoadError> {
    if let Some(leader) = distributed::lockstep::leader() {
        leader
            .wait_formed(GROUP_FORM_TIMEOUT)
            .map_err(LoadError::Mlx)?;
    }
    // In a process group (`distributed::join`), this rank's part of it.
    let model = match distributed::group() {
        Some(group) => {
            let model = LoadedModel::load_shard(path, &group)?;
            if let Some(plan) = model.transformer.shard_label() {
                tracing::info!(model = %model.id, %plan, "model split over processes");
            }
            model
        }
        None => LoadedModel::load(path)?,
    };
    mlx_rs::transforms::eval(model.transformer.parameters())
        .map_err(|error| LoadError::Mlx(error.to_string()))?;
    model.transformer.prepare_decode();
    // Loading freed buffers of every size (whole tensors decoded, cut or
    // repacked); MLX would keep them all for reuse.
    if let Err(error) = mlx_rs::memory::clear_cache() {
        tracing::debug!(%error, "cannot clear MLX's buffer cache");
    }
    Ok(model)
}

/// This rank's slice of the model at `path`, loaded for a worker of a
/// served process group (after it joined the group).
pub fn load_for_worker(path: &Path) -> Result<model::Transformer, LoadError> {
    load_for_serving(path).map(|model| model.transformer)
}

/// What clients are told of a loaded model.
fn model_card(model: &LoadedModel) -> ModelCard {
    let config = &model.transformer.config;
    ModelCard {
        id: model.id.clone(),
        architecture: config.family.name().to_owned(),
        context_length: config.context_length,
        vocab_size: config.vocab_size,
        hidden_size: config.hidden_size,
        max_prompt_bytes: config
            .context_length
            .saturating_mul(model.codec.longest_token_bytes().max(1)),
    }
}

/// What a prompt cache saved for the model at `path` must match to be
/// reused, for the base model (an adapter set is added where one is used,
/// by [`Fingerprint::with_adapters`]).
fn cache_fingerprint(model: &LoadedModel, path: &Path) -> Fingerprint {
    let config = &model.transformer.config;
    Fingerprint {
        model: model.id.clone(),
        architecture: config.family.name().to_owned(),
        weights: prompt_cache::weights_digest(path),
        quantization: model.transformer.quantization_label(),
        dtype: prompt_cache::tensors::dtype_name(model::compute_dtype()).to_owned(),
        layers: config.layers,
        kv_heads: config.kv_heads,
        head_dim: config.head_dim,
        adapters: String::new(),
    }
}

impl EngineHandle {
    /// Loads the model at `path` with default options. Blocking.
    pub fn load(path: &Path) -> Result<EngineHandle, LoadError> {
        EngineHandle::load_with(path, EngineOptions::default())
    }

    /// Loads the model at `path` and starts its engine thread. Blocking.
    ///
    /// Loading happens on the engine thread itself: MLX ties arrays to the
    /// stream of the thread that created them, so the thread that evaluates
    /// the model must be the one that loaded it.
    pub fn load_with(path: &Path, options: EngineOptions) -> Result<EngineHandle, LoadError> {
        let path = path.to_owned();
        let store = options.prompt_cache.store.clone();
        let cache_stats = Arc::new(CacheStats::default());
        let scheduler_stats = Arc::clone(&cache_stats);
        let (ready, loaded) = mpsc::channel();
        let (jobs, receiver) = mpsc::channel();
        let admission = Admission::new(&options.scheduling);
        let scheduler_admission = Arc::clone(&admission);
        let name = format!("engine-{}", model::model_id(&path));
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                kernels::prepare_engine_thread(options.kernels);
                crate::mlx::limit_gpu_buffer_cache();
                let model = match load_for_serving(&path) {
                    Ok(model) => model,
                    Err(error) => {
                        let _ = ready.send(Err(error));
                        return;
                    }
                };
                let card = model_card(&model);
                let fingerprint = cache_fingerprint(&model, &path);
                let codec = Arc::new(model.codec);
                if ready
                    .send(Ok((card, Arc::clone(&codec), fingerprint.clone())))
                    .is_ok()
                {
                    let caching = Caching {
                        options: options.prompt_cache,
                        fingerprint,
                        stats: scheduler_stats,
                    };
                    Scheduler::new(
                        model.transformer,
                        codec,
                        options.scheduling,
                        scheduler_admission,
                        caching,
                    )
                    .with_faults(options.faults)
                    .run(receiver);
                }
            })
            .map_err(|e| LoadError::Io(PathBuf::from("engine thread"), e.to_string()))?;
        let (card, codec, fingerprint) = loaded
            .recv()
            .map_err(|_| LoadError::Mlx("the engine thread stopped while loading".into()))??;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                card,
                in_flight: Arc::new(AtomicUsize::new(0)),
                admission,
                codec,
                fingerprint,
                cache_stats,
                store,
                adapters: Default::default(),
                jobs: Mutex::new(Some(jobs)),
                thread: Some(thread),
            }),
        })
    }

    /// Generations alive (queued or running) and those still waiting for
    /// the engine thread to admit them: what routing policies see as load.
    pub fn current_load(&self) -> (usize, usize) {
        (
            self.inner.in_flight.load(Ordering::Relaxed),
            self.inner.admission.waiting(),
        )
    }

    /// The queue's depth, bound and refusals, for `/metrics`.
    pub fn queue_stats(&self) -> QueueStats {
        self.inner.admission.stats()
    }

    pub fn card(&self) -> &ModelCard {
        &self.inner.card
    }

    /// The prompt text for `messages`, from the model's chat template.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.inner
            .codec
            .render_chat(messages)
            .map_err(EngineError::Template)
    }

    /// Refuses prompt text longer than any that fits the context, before
    /// anything tokenizes or renders it.
    pub fn check_prompt_bytes(&self, bytes: usize) -> Result<(), EngineError> {
        let card = &self.inner.card;
        if bytes > card.max_prompt_bytes {
            return Err(EngineError::PromptTooLong {
                context_length: card.context_length,
                bytes,
                max_bytes: card.max_prompt_bytes,
            });
        }
        Ok(())
    }

    /// The prompt ids for `messages`, from the model's chat template, with
    /// the assistant turn's opening; special tokens come only from the
    /// template, never from message content (`TextCodec::encode_chat`).
    pub fn chat_tokens(
        &self,
        messages: &[ChatMessage],
        tools: &ToolUse,
    ) -> Result<Vec<u32>, EngineError> {
        self.check_chat_bytes(messages)?;
        let codec = &self.inner.codec;
        let prompt = tools::prompt(codec.tool_format(), messages, tools);
        codec
            .encode_chat_with_tools(&prompt.messages, &prompt.tools, true)
            .map_err(EngineError::Template)
    }

    /// The grammar a chat request's output must match: its tools' calls
    /// in this model's markup and its response format ([`tools::grammar`]).
    pub fn output_grammar(
        &self,
        tools: &ToolUse,
        answer: Option<&Grammar>,
    ) -> Result<Option<Grammar>, EngineError> {
        tools::grammar(self.inner.codec.tool_format(), tools, answer).map_err(EngineError::Grammar)
    }

    /// Reads tool calls out of this model's output.
    pub fn call_parser(&self) -> tools::CallParser {
        tools::CallParser::new(self.inner.codec.tool_format())
    }

    /// [`EngineHandle::chat_tokens`] without the assistant turn's opening: a
    /// prefix later conversations extend (for saved prompt caches).
    pub fn chat_prefix_tokens(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        self.check_chat_bytes(messages)?;
        self.inner
            .codec
            .encode_chat(messages, false)
            .map_err(EngineError::Template)
    }

    /// [`EngineHandle::check_prompt_bytes`] for the messages' text, before
    /// the template copies it.
    fn check_chat_bytes(&self, messages: &[ChatMessage]) -> Result<(), EngineError> {
        self.check_prompt_bytes(
            messages
                .iter()
                .map(|m| {
                    let calls: usize = m
                        .tool_calls
                        .iter()
                        .map(|c| c.name.len() + c.arguments.len())
                        .sum();
                    m.content.len() + calls
                })
                .sum(),
        )
    }

    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.check_prompt_bytes(text.len())?;
        self.inner
            .codec
            .encode(text)
            .map_err(EngineError::InvalidPrompt)
    }

    /// The token ids of `prompt`: tokenized text, or ids checked against the
    /// vocabulary. An empty prompt is an error.
    pub fn prompt_tokens(&self, prompt: Prompt) -> Result<Vec<u32>, EngineError> {
        let vocab = self.inner.card.vocab_size;
        let ids = match prompt {
            Prompt::Text(text) => self.tokenize(&text)?,
            Prompt::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(EngineError::InvalidPrompt(format!(
                        "token id {bad} is outside the vocabulary (size {vocab})"
                    )));
                }
                ids
            }
        };
        if ids.is_empty() {
            return Err(EngineError::InvalidPrompt("the prompt is empty".into()));
        }
        Ok(ids)
    }

    /// Validates `request` (prompt, context length) and queues it.
    pub fn generate(&self, request: GenerateRequest) -> Result<GenerationStream, EngineError> {
        let mut streams = self.generate_n(request, 1)?;
        Ok(streams.remove(0))
    }

    /// `n` (at least 1) choices of one request, one stream each: the prompt
    /// is prefilled once and each choice samples on its own (with a seed,
    /// choice `i` uses `seed + i`).
    pub fn generate_n(
        &self,
        mut request: GenerateRequest,
        n: usize,
    ) -> Result<Vec<GenerationStream>, EngineError> {
        if distributed::lockstep::leader().is_some() {
            Self::check_split_request(&request, n)?;
        }
        let prompt = self.prompt_tokens(std::mem::replace(
            &mut request.prompt,
            Prompt::Tokens(Vec::new()),
        ))?;
        let context = self.inner.card.context_length;
        self.check_fits(prompt.len(), &request)?;
        let constraint = match &request.grammar {
            Some(grammar) => Some(self.compile(grammar)?),
            None => None,
        };
        let prompt_cache = match &request.prompt_cache {
            Some(name) => Some(self.open_named_cache(
                name,
                &request.cache_scope,
                &prompt,
                &request.adapters.join("+"),
            )?),
            None => None,
        };
        // Last: a request refused for any other reason takes no place.
        let ticket = self
            .inner
            .admission
            .enter(request.cache_scope.tenant.as_deref())?;
        let prompt_tokens = prompt.len();
        let mut streams = Vec::with_capacity(n);
        let mut stream = || {
            let (events, receiver) = unbounded_channel();
            streams.push(GenerationStream {
                receiver,
                prompt_tokens,
                queue_wait: ticket.waited(),
                observer: None,
                _in_flight: InFlight::new(&self.inner.in_flight),
            });
            events
        };
        let events = stream();
        let seed = request.sampling.seed;
        let forks = (1..n.max(1))
            .map(|i| Fork {
                seed: seed.map(|s| s.wrapping_add(i as u64)),
                constraint: constraint.as_ref().map(Constraint::fork),
                events: stream(),
            })
            .collect();
        let job = Job {
            max_new_tokens: request.max_tokens.unwrap_or(context - prompt_tokens).max(1),
            prompt,
            sampling: request.sampling,
            stop: request.stop,
            logprobs: request.logprobs,
            prompt_cache,
            adapters: request.adapters,
            cache_scope: request.cache_scope,
            constraint,
            events,
            forks,
            ticket,
            priority: request.priority,
        };
        self.send(Command::Generate(Box::new(job)))?;
        Ok(streams)
    }
}

impl EngineHandle {
    /// Refuses a request whose prompt plus `max_tokens` overflows the
    /// context, or that names an adapter not mounted.
    /// What a model split over served processes cannot do, refused before
    /// it is queued; and every request while its group cannot serve.
    fn check_split_request(request: &GenerateRequest, n: usize) -> Result<(), EngineError> {
        let unsupported = if n > 1 {
            Some("n > 1")
        } else if request.prompt_cache.is_some() {
            Some("prompt_cache")
        } else if !request.adapters.is_empty() {
            Some("adapters")
        } else {
            None
        };
        if let Some(what) = unsupported {
            return Err(EngineError::InvalidPrompt(format!(
                "{what} is not available for a model split over processes (mlxgate serve --hostfile)"
            )));
        }
        match distributed::lockstep::not_serving() {
            Some(why) => Err(EngineError::ProcessGroup(why)),
            None => Ok(()),
        }
    }

    fn check_fits(&self, prompt_len: usize, request: &GenerateRequest) -> Result<(), EngineError> {
        let context = self.inner.card.context_length;
        let wanted = request.max_tokens.unwrap_or(1).max(1);
        if prompt_len + wanted > context {
            return Err(EngineError::ContextLengthExceeded {
                context_length: context,
                prompt_tokens: prompt_len,
                max_tokens: wanted,
                requested: prompt_len + wanted,
            });
        }
        let mounted = self
            .inner
            .adapters
            .read()
            .unwrap_or_else(|e| e.into_inner());
        match request
            .adapters
            .iter()
            .find(|id| !mounted.contains_key(*id))
        {
            Some(unknown) => Err(EngineError::UnknownAdapter {
                requested: unknown.clone(),
                mounted: mounted.keys().cloned().collect(),
            }),
            None => Ok(()),
        }
    }

    /// `grammar` compiled for one sequence of this model, on the caller's
    /// thread (a schema that compiles slowly never holds the engine up).
    fn compile(&self, grammar: &Grammar) -> Result<Constraint, EngineError> {
        let rows = self.inner.card.vocab_size;
        let grammars = self
            .inner
            .codec
            .grammars(rows)
            .map_err(EngineError::Grammar)?;
        grammars.compile(grammar).map_err(|message| match grammar {
            Grammar::ToolCalls(_) => EngineError::ToolSchema(message),
            _ => EngineError::Grammar(message),
        })
    }

    /// Embeddings of `inputs` (token ids): each one's final-normed hidden
    /// state at its last position, L2-normalized. Runs on the engine thread
    /// between decode steps, one input at a time.
    pub async fn embed_last_token(
        &self,
        inputs: Vec<Vec<u32>>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Command::Embed { inputs, reply })?;
        answer.await.map_err(|_| EngineError::Unavailable)?
    }

    fn send(&self, command: Command) -> Result<(), EngineError> {
        let jobs = self
            .inner
            .jobs
            .lock()
            .map_err(|_| EngineError::Unavailable)?;
        let jobs = jobs.as_ref().ok_or(EngineError::Unavailable)?;
        jobs.send(command).map_err(|_| EngineError::Unavailable)
    }

    pub fn prompt_cache_stats(&self) -> CacheStatsSnapshot {
        self.inner.cache_stats.snapshot()
    }

    /// Maps and checks the named cache a request asked for: it must exist,
    /// be `scope`'s to use (another tenant's is "not found", as if absent),
    /// fit this model and share a prefix with `prompt`. Blocking (reads and
    /// checksums the file).
    fn open_named_cache(
        &self,
        name: &str,
        scope: &CacheScope,
        prompt: &[u32],
        adapters: &str,
    ) -> Result<Arc<prompt_cache::file::MappedFile>, EngineError> {
        let fingerprint = self.inner.fingerprint.with_adapters(adapters);
        let store = self.inner.store.as_ref().ok_or_else(|| {
            EngineError::PromptCache("prompt caches are not enabled on this server".into())
        })?;
        let (path, header) = store
            .header_for(name, scope)
            .ok_or_else(|| EngineError::PromptCacheNotFound(name.to_owned()))?;
        let unusable = |why: String| {
            EngineError::PromptCache(format!("prompt cache `{name}` cannot be used: {why}"))
        };
        if let Some(why) = header.fingerprint.mismatch(&fingerprint) {
            return Err(unusable(why));
        }
        let shared = prompt_cache::common_prefix(&header.tokens, prompt);
        if shared == 0 || !prompt_cache::store::file_reusable(&header, shared.min(prompt.len() - 1))
        {
            return Err(unusable(format!(
                "this prompt does not start with its {} tokens",
                header.tokens.len()
            )));
        }
        CacheStore::open_file(&path, &fingerprint)
            .map(Arc::new)
            .map_err(|e| unusable(e.to_string()))
    }

    /// Prefills `prompt` (from [`EngineHandle::prompt_tokens`]) and saves its
    /// cache as the operator's file `name` (no owner: admins only). Blocking.
    pub fn save_prompt_cache(
        &self,
        name: &str,
        prompt: Vec<u32>,
    ) -> Result<CacheInfo, EngineError> {
        let store = self.store()?;
        prompt_cache::store::validate_name(name).map_err(EngineError::PromptCache)?;
        let layers = self.snapshot_prompt(&prompt, &CacheScope::operator())?;
        store
            .save(name, None, &self.inner.fingerprint, &prompt, &layers)
            .map_err(|e| EngineError::Internal(format!("cannot write the prompt cache: {e}")))
    }

    /// Saves `prompt`'s cache as `scope`'s tenant's named cache `name`:
    /// refused (the outer `Ok(Err)`) when the name is another tenant's or the
    /// tenant's named caches would outgrow their disk budget. Blocking.
    pub fn save_named_prompt_cache(
        &self,
        name: &str,
        scope: &CacheScope,
        prompt: Vec<u32>,
    ) -> Result<Result<CacheInfo, SaveError>, EngineError> {
        let store = self.store()?;
        prompt_cache::store::validate_new_name(name).map_err(EngineError::PromptCache)?;
        // Cheap refusal before the prefill; `save_named` checks again.
        if let Err(taken) = store.check_name(name, scope) {
            return Ok(Err(taken));
        }
        let layers = self.snapshot_prompt(&prompt, scope)?;
        Ok(store.save_named(name, scope, &self.inner.fingerprint, &prompt, &layers))
    }

    fn store(&self) -> Result<Arc<CacheStore>, EngineError> {
        self.inner.store.clone().ok_or_else(|| {
            EngineError::PromptCache("prompt caches are not enabled on this server".into())
        })
    }

    /// Prefills `prompt` (reusing only what `scope` may) and returns its
    /// cache as bytes. Blocking: waits for the engine thread.
    fn snapshot_prompt(
        &self,
        prompt: &[u32],
        scope: &CacheScope,
    ) -> Result<Vec<prompt_cache::file::LayerBytes>, EngineError> {
        let context = self.inner.card.context_length;
        if prompt.len() > context {
            return Err(EngineError::ContextLengthExceeded {
                context_length: context,
                prompt_tokens: prompt.len(),
                max_tokens: 0,
                requested: prompt.len(),
            });
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Command::Snapshot {
            prompt: prompt.to_vec(),
            scope: scope.clone(),
            reply,
        })?;
        answer
            .blocking_recv()
            .map_err(|_| EngineError::Unavailable)?
    }
}

impl EngineHandle {
    /// Mounts the adapter in `dir` as `id` (all or nothing). Blocking.
    pub fn mount_adapter(&self, id: &str, dir: &Path) -> Result<lora::AdapterInfo, EngineError> {
        lora::validate_id(id).map_err(|e| EngineError::Adapter(e.to_string()))?;
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Command::Mount {
            id: id.to_owned(),
            path: dir.to_owned(),
            reply,
        })?;
        let info = answer
            .blocking_recv()
            .map_err(|_| EngineError::Unavailable)??;
        self.inner
            .adapters
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), info.clone());
        Ok(info)
    }

    /// Unmounts `id`; false if it was not mounted. Requests already using it
    /// finish with it. Blocking.
    pub fn unmount_adapter(&self, id: &str) -> Result<bool, EngineError> {
        self.inner
            .adapters
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Command::Unmount {
            id: id.to_owned(),
            reply,
        })?;
        answer.blocking_recv().map_err(|_| EngineError::Unavailable)
    }

    /// The mounted adapters, by id.
    pub fn adapters(&self) -> Vec<lora::AdapterInfo> {
        let mounted = self
            .inner
            .adapters
            .read()
            .unwrap_or_else(|e| e.into_inner());
        mounted.values().cloned().collect()
    }
}

/// Events of one generation; dropping it cancels the generation.
pub struct GenerationStream {
    receiver: UnboundedReceiver<Result<GenerateEvent, EngineError>>,
    prompt_tokens: usize,
    /// Set when the request leaves the model's queue (it starts).
    queue_wait: Arc<std::sync::OnceLock<std::time::Duration>>,
    /// Sees each event before the reader does (token accounting).
    observer: Option<StreamObserver>,
    _in_flight: InFlight,
}

/// A function shown each event of a stream before its reader gets it,
/// with how long the request waited in the queue (`None` while it waits).
pub type StreamObserver =
    Box<dyn FnMut(&Result<GenerateEvent, EngineError>, Option<std::time::Duration>) + Send>;

/// Counts a live stream in `EngineHandle::current_load` until it is dropped.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(counter: &Arc<AtomicUsize>) -> InFlight {
        counter.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(counter))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl GenerationStream {
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// How long the request waited in the model's queue before it started;
    /// `None` while it still waits.
    pub fn queue_wait(&self) -> Option<std::time::Duration> {
        self.queue_wait.get().copied()
    }

    /// Shows every later event to `observer` first.
    pub fn observe(&mut self, observer: StreamObserver) {
        self.observer = Some(observer);
    }

    /// The next event; `None` after `Finished` or an error.
    pub async fn next(&mut self) -> Option<Result<GenerateEvent, EngineError>> {
        let event = self.receiver.recv().await;
        self.show(event)
    }

    /// Blocking variant for non-async callers (CLI, benches).
    pub fn blocking_next(&mut self) -> Option<Result<GenerateEvent, EngineError>> {
        let event = self.receiver.blocking_recv();
        self.show(event)
    }

    fn show(
        &mut self,
        event: Option<Result<GenerateEvent, EngineError>>,
    ) -> Option<Result<GenerateEvent, EngineError>> {
        if let (Some(observer), Some(e)) = (&mut self.observer, &event) {
            observer(e, self.queue_wait.get().copied());
        }
        event
    }
}
