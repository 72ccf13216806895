//! The inference engine: model files loaded through MLX, tokenizer and chat
//! template, sampling, and a scheduler thread per model doing continuous
//! batching. Knows nothing of HTTP; its API ([`api`]) has no MLX types.

pub mod api;
pub mod convert;
pub mod model;
mod output;
mod sampler;
mod scheduler;
pub mod text;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

pub use api::*;
pub use model::LoadError;
use model::Transformer;
use scheduler::{Job, Scheduler};
use text::TextCodec;

/// Most sequences decoded together in one step.
const MAX_BATCH: usize = 16;

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
    /// Generations sent to the engine thread and not yet admitted.
    queued: Arc<AtomicUsize>,
    codec: Arc<TextCodec>,
    /// `None` once the engine is shutting down.
    jobs: Mutex<Option<Sender<Job>>>,
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
    pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
        let id = crate::mlx::model_id(path);
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

impl EngineHandle {
    /// Loads the model at `path` and starts its engine thread. Blocking.
    ///
    /// Loading happens on the engine thread itself: MLX ties arrays to the
    /// stream of the thread that created them, so the thread that evaluates
    /// the model must be the one that loaded it.
    pub fn load(path: &Path) -> Result<EngineHandle, LoadError> {
        let path = path.to_owned();
        let (ready, loaded) = mpsc::channel();
        let (jobs, receiver) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let scheduler_queued = Arc::clone(&queued);
        let name = format!("engine-{}", crate::mlx::model_id(&path));
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let model = match LoadedModel::load(&path) {
                    Ok(model) => model,
                    Err(error) => {
                        let _ = ready.send(Err(error));
                        return;
                    }
                };
                if let Err(error) = mlx_rs::transforms::eval(model.transformer.parameters()) {
                    let _ = ready.send(Err(LoadError::Mlx(error.to_string())));
                    return;
                }
                let config = &model.transformer.config;
                let card = ModelCard {
                    id: model.id.clone(),
                    architecture: config.family.name().to_owned(),
                    context_length: config.context_length,
                    vocab_size: config.vocab_size,
                };
                let codec = Arc::new(model.codec);
                if ready.send(Ok((card, Arc::clone(&codec)))).is_ok() {
                    Scheduler::new(model.transformer, codec, MAX_BATCH, scheduler_queued)
                        .run(receiver);
                }
            })
            .map_err(|e| LoadError::Io(PathBuf::from("engine thread"), e.to_string()))?;
        let (card, codec) = loaded
            .recv()
            .map_err(|_| LoadError::Mlx("the engine thread stopped while loading".into()))??;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                card,
                in_flight: Arc::new(AtomicUsize::new(0)),
                queued,
                codec,
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
            self.inner.queued.load(Ordering::Relaxed),
        )
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

    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.inner
            .codec
            .encode(text)
            .map_err(EngineError::InvalidPrompt)
    }

    /// Validates `request` (prompt, context length) and queues it.
    pub fn generate(&self, request: GenerateRequest) -> Result<GenerationStream, EngineError> {
        let card = &self.inner.card;
        let prompt = match request.prompt {
            Prompt::Text(text) => self.tokenize(&text)?,
            Prompt::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= card.vocab_size) {
                    return Err(EngineError::InvalidPrompt(format!(
                        "token id {bad} is outside the vocabulary (size {})",
                        card.vocab_size
                    )));
                }
                ids
            }
        };
        if prompt.is_empty() {
            return Err(EngineError::InvalidPrompt("the prompt is empty".into()));
        }
        let context = card.context_length;
        let wanted = request.max_tokens.unwrap_or(1).max(1);
        if prompt.len() + wanted > context {
            return Err(EngineError::ContextLengthExceeded {
                context_length: context,
                prompt_tokens: prompt.len(),
                max_tokens: wanted,
                requested: prompt.len() + wanted,
            });
        }
        let (events, receiver) = unbounded_channel();
        let prompt_tokens = prompt.len();
        let job = Job {
            max_new_tokens: request.max_tokens.unwrap_or(context - prompt_tokens).max(1),
            prompt,
            sampling: request.sampling,
            stop: request.stop,
            logprobs: request.logprobs,
            events,
        };
        let jobs = self
            .inner
            .jobs
            .lock()
            .map_err(|_| EngineError::Unavailable)?;
        let jobs = jobs.as_ref().ok_or(EngineError::Unavailable)?;
        self.inner.queued.fetch_add(1, Ordering::Relaxed);
        if jobs.send(job).is_err() {
            self.inner.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(EngineError::Unavailable);
        }
        Ok(GenerationStream {
            receiver,
            prompt_tokens,
            _in_flight: InFlight::new(&self.inner.in_flight),
        })
    }
}

/// Events of one generation; dropping it cancels the generation.
pub struct GenerationStream {
    receiver: UnboundedReceiver<Result<GenerateEvent, EngineError>>,
    prompt_tokens: usize,
    _in_flight: InFlight,
}

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

    /// The next event; `None` after `Finished` or an error.
    pub async fn next(&mut self) -> Option<Result<GenerateEvent, EngineError>> {
        self.receiver.recv().await
    }

    /// Blocking variant for non-async callers (CLI, benches).
    pub fn blocking_next(&mut self) -> Option<Result<GenerateEvent, EngineError>> {
        self.receiver.blocking_recv()
    }
}
