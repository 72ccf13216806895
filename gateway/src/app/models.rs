//! The served models and where each stands: loading, ready or failed.
//!
//! Models load one after another on a plain OS thread (so shutdown never
//! waits for a slow load, and two loads don't compete for memory), in
//! config order; each becomes usable as soon as it is ready. `/readyz` is
//! 200 once all are.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Instant, SystemTime};

use tracing::{error, info};

use super::adapters::StartupMount;
use crate::config::ModelSpec;
use crate::engine::embed::{Embedder, EncoderHandle};
use crate::engine::{EngineHandle, EngineOptions};
use crate::util::BoxError;

/// Loads one model (blocking) and starts its engine. Passed in by the
/// binary, which wires it to `EngineHandle::load_with` or, for encoder
/// directories, `EncoderHandle::load`.
pub type ModelLoader = Box<dyn Fn(&Path, &EngineOptions) -> Result<Engine, BoxError> + Send>;

/// What a loaded model runs on.
pub enum Engine {
    /// A decoder: chat, completions (and embeddings where enabled).
    Chat(EngineHandle),
    /// An encoder: embeddings only.
    Encoder(EncoderHandle),
}

/// Why a request's model cannot serve it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// No configured model has this id (once every id is known).
    #[error("The model `{0}` does not exist or you do not have access to it.")]
    NotFound(String),
    /// The model is loading or failed to load; the message says which.
    #[error("{0}")]
    NotReady(String),
    /// An embedding model asked for text, or a chat model for embeddings.
    #[error("{0}")]
    WrongKind(String),
}

/// Where one model's loading stands.
#[derive(Clone)]
pub enum ModelState {
    Loading,
    Ready(LoadedModel),
    /// An embedding model, ready.
    ReadyEncoder(LoadedEncoder),
    Failed {
        reason: String,
    },
}

/// An encoder model that can serve embeddings.
#[derive(Clone)]
pub struct LoadedEncoder {
    pub id: String,
    pub path: PathBuf,
    pub created: u64,
    pub encoder: EncoderHandle,
}

/// A model that can serve.
#[derive(Clone)]
pub struct LoadedModel {
    /// The id clients use (`model` in requests, `/v1/models/{id}`).
    pub id: String,
    pub path: PathBuf,
    /// Unix seconds: the model file's modification time (OpenAI's
    /// `created`), or the load time if the file system has none.
    pub created: u64,
    pub engine: EngineHandle,
}

/// One configured model and its state.
#[derive(Clone)]
pub struct Slot {
    pub spec: ModelSpec,
    pub state: ModelState,
}

pub struct ModelRegistry {
    slots: RwLock<Vec<Slot>>,
}

impl ModelState {
    fn is_ready(&self) -> bool {
        matches!(self, ModelState::Ready(_) | ModelState::ReadyEncoder(_))
    }
}

impl ModelRegistry {
    pub fn new(specs: &[ModelSpec]) -> Self {
        let slots = specs
            .iter()
            .map(|spec| Slot {
                spec: spec.clone(),
                state: ModelState::Loading,
            })
            .collect();
        ModelRegistry {
            slots: RwLock::new(slots),
        }
    }

    /// Every configured model with its state, in config order.
    pub fn slots(&self) -> Vec<Slot> {
        self.slots.read().map(|s| s.clone()).unwrap_or_default()
    }

    /// The models that can serve now, in config order.
    pub fn ready(&self) -> Vec<LoadedModel> {
        self.slots()
            .into_iter()
            .filter_map(|s| match s.state {
                ModelState::Ready(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    /// The embedding models that can serve now, in config order.
    pub fn ready_encoders(&self) -> Vec<LoadedEncoder> {
        self.slots()
            .into_iter()
            .filter_map(|s| match s.state {
                ModelState::ReadyEncoder(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    pub fn all_ready(&self) -> bool {
        self.slots().iter().all(|s| s.state.is_ready())
    }

    /// The model that serves `/v1/embeddings` for `id`: an encoder, or a
    /// chat model whose `[[models]]` entry has `embeddings = true`.
    pub fn resolve_embedder(&self, id: &str) -> Result<Embedder, ModelError> {
        for slot in self.slots() {
            match slot.state {
                ModelState::ReadyEncoder(m) if m.id == id => {
                    return Ok(Embedder::Encoder(m.encoder));
                }
                ModelState::Ready(m) if m.id == id && slot.spec.embeddings => {
                    return Ok(Embedder::Decoder(m.engine));
                }
                ModelState::Ready(m) if m.id == id => {
                    return Err(ModelError::WrongKind(format!(
                        "The model `{id}` is a chat model and does not serve embeddings. Use an embedding model (GET /v1/models lists each model's `capabilities`), send embeddings to an upstream that serves them (list the model in its `[[upstreams]] models`, or route it with a router policy), or let this model embed with last-token pooling: `embeddings = true` in its [[models]] entry."
                    )));
                }
                _ => {}
            }
        }
        // Loading, failed or unknown: the answer every endpoint gives.
        match self.resolve(id) {
            // Ready since the loop looked (models never unload): look again.
            Ok(_) | Err(ModelError::WrongKind(_)) => self.resolve_embedder(id),
            Err(error) => Err(error),
        }
    }

    /// The model a request names: 404 if no configured model has that id,
    /// 503 if it (or, for ids only known after loading, any model) is still
    /// loading or failed.
    pub fn resolve(&self, id: &str) -> Result<LoadedModel, ModelError> {
        let slots = self.slots();
        if let Some(m) = slots.iter().find_map(|s| match &s.state {
            ModelState::Ready(m) if m.id == id => Some(m.clone()),
            _ => None,
        }) {
            return Ok(m);
        }
        if slots
            .iter()
            .any(|s| matches!(&s.state, ModelState::ReadyEncoder(m) if m.id == id))
        {
            return Err(ModelError::WrongKind(format!(
                "The model `{id}` is an embedding model: it serves POST /v1/embeddings only. Send chat and completions to a chat model (GET /v1/models lists each model's `capabilities`)."
            )));
        }
        if let Some(s) = slots.iter().find(|s| s.spec.id.as_deref() == Some(id)) {
            return Err(not_ready(id, s));
        }
        // An unaliased model's id is known only once it has loaded.
        if let Some(s) = slots
            .iter()
            .find(|s| s.spec.id.is_none() && matches!(s.state, ModelState::Loading))
        {
            return Err(ModelError::NotReady(format!(
                "The model `{id}` is not available yet: model {} is still loading. Try again shortly; GET /readyz answers 200 once every model is ready.",
                s.spec.path.display()
            )));
        }
        Err(ModelError::NotFound(id.to_owned()))
    }

    /// Why `/readyz` is not 200, or `None` when every model is ready.
    pub fn not_ready_reason(&self) -> Option<String> {
        let mut reasons: Vec<String> = self
            .slots()
            .iter()
            .filter_map(|s| match &s.state {
                ModelState::Ready(_) | ModelState::ReadyEncoder(_) => None,
                ModelState::Loading => {
                    Some(format!("model {} is still loading", s.spec.path.display()))
                }
                ModelState::Failed { reason } => Some(format!(
                    "model {} failed to load: {reason}",
                    s.spec.path.display()
                )),
            })
            .collect();
        // A model split over processes serves only while its group does.
        reasons.extend(crate::engine::distributed::lockstep::not_serving());
        (!reasons.is_empty()).then(|| format!("not ready: {}", reasons.join("; ")))
    }

    fn set(&self, index: usize, state: ModelState) {
        if let Ok(mut slots) = self.slots.write()
            && let Some(slot) = slots.get_mut(index)
        {
            slot.state = state;
        }
    }

    /// The id a newly loaded model gets, or why it cannot be served.
    fn claim_id(&self, index: usize, id: &str) -> Result<(), String> {
        let slots = self.slots();
        for (i, s) in slots.iter().enumerate() {
            let taken = match &s.state {
                ModelState::Ready(m) => m.id == id,
                ModelState::ReadyEncoder(m) => m.id == id,
                _ => s.spec.id.as_deref() == Some(id),
            };
            if i != index && taken {
                return Err(format!(
                    "model id `{id}` is already used by {}; give one of them an `id` in [[models]]",
                    s.spec.path.display()
                ));
            }
        }
        Ok(())
    }

    /// Loads every model with `load`, in order, on its own OS thread.
    /// `mounts` are the adapters to mount on each model as it loads.
    pub fn load_in_background(
        self: &Arc<Self>,
        load: ModelLoader,
        options: EngineOptions,
        mounts: Vec<StartupMount>,
    ) {
        let registry = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("model-load".into())
            .spawn(move || {
                let specs: Vec<ModelSpec> = registry.slots().into_iter().map(|s| s.spec).collect();
                for (index, spec) in specs.into_iter().enumerate() {
                    let state = load_one(&registry, index, &spec, &|path| load(path, &options));
                    if let ModelState::Ready(model) = &state {
                        super::adapters::mount_at_start(model, index, &mounts);
                    }
                    registry.set(index, state);
                }
            });
        if let Err(e) = spawned {
            error!(error = %e, "cannot start the model loader thread");
            let count = self.slots().len();
            for index in 0..count {
                self.set(
                    index,
                    ModelState::Failed {
                        reason: format!("cannot start loader thread: {e}"),
                    },
                );
            }
        }
    }
}

fn not_ready(id: &str, slot: &Slot) -> ModelError {
    match &slot.state {
        ModelState::Failed { reason } => ModelError::NotReady(format!(
            "The model `{id}` failed to load ({}): {reason}",
            slot.spec.path.display()
        )),
        _ => ModelError::NotReady(format!(
            "The model `{id}` is still loading. Try again shortly; GET /readyz answers 200 once every model is ready."
        )),
    }
}

fn load_one(
    registry: &ModelRegistry,
    index: usize,
    spec: &ModelSpec,
    load: &dyn Fn(&Path) -> Result<Engine, BoxError>,
) -> ModelState {
    let path = &spec.path;
    info!(path = %path.display(), "loading model");
    let started = Instant::now();
    match std::panic::catch_unwind(AssertUnwindSafe(|| load(path))) {
        Ok(Ok(engine)) => {
            let engine_id = match &engine {
                Engine::Chat(chat) => chat.card().id.clone(),
                Engine::Encoder(encoder) => encoder.card().id.clone(),
            };
            let id = spec.id.clone().unwrap_or(engine_id);
            if let Err(reason) = registry.claim_id(index, &id) {
                error!(path = %path.display(), %reason, "model failed to load");
                return ModelState::Failed { reason };
            }
            let created = std::fs::metadata(path)
                .and_then(|m| m.modified())
                .unwrap_or_else(|_| SystemTime::now());
            let created = crate::util::time::unix_secs_at(created);
            let elapsed_ms = started.elapsed().as_millis() as u64;
            let path = path.clone();
            match engine {
                Engine::Chat(engine) => {
                    let card = engine.card();
                    info!(model = %id, architecture = %card.architecture, context_length = card.context_length,
                        elapsed_ms, "model ready");
                    ModelState::Ready(LoadedModel {
                        id,
                        path,
                        created,
                        engine,
                    })
                }
                Engine::Encoder(encoder) => {
                    let card = encoder.card();
                    info!(model = %id, architecture = %card.architecture, dimensions = card.dimensions,
                        max_tokens = card.max_tokens, pooling = card.pooling.name(),
                        normalized = card.normalized, elapsed_ms, "embedding model ready");
                    ModelState::ReadyEncoder(LoadedEncoder {
                        id,
                        path,
                        created,
                        encoder,
                    })
                }
            }
        }
        Ok(Err(e)) => {
            error!(path = %path.display(), error = %e, "model failed to load");
            ModelState::Failed {
                reason: e.to_string(),
            }
        }
        Err(_) => {
            error!(path = %path.display(), "model loader panicked");
            ModelState::Failed {
                reason: "the loader panicked (see the log)".into(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(path: &str, id: Option<&str>) -> ModelSpec {
        ModelSpec {
            path: path.into(),
            id: id.map(Into::into),
            embeddings: false,
        }
    }

    fn code(r: Result<LoadedModel, ModelError>) -> (u16, &'static str, String) {
        match r {
            Ok(m) => panic!("resolved to {}", m.id),
            Err(e @ ModelError::NotFound(_)) => (404, "model_not_found", e.to_string()),
            Err(e @ ModelError::NotReady(_)) => (503, "model_not_ready", e.to_string()),
            Err(e @ ModelError::WrongKind(_)) => (400, "model_not_supported", e.to_string()),
        }
    }

    #[test]
    fn loading_models_answer_503_and_unknown_ids_404_once_all_settled() {
        let r = ModelRegistry::new(&[spec("a.gguf", None), spec("b.gguf", Some("bee"))]);
        assert!(!r.all_ready());
        assert!(r.ready().is_empty());
        let why = r.not_ready_reason().unwrap();
        assert!(why.contains("a.gguf is still loading"), "{why}");

        // The alias is known before loading; any id may be the unaliased one's.
        let (status, c, msg) = code(r.resolve("bee"));
        assert_eq!((status, c), (503, "model_not_ready"));
        assert!(msg.contains("still loading"), "{msg}");
        assert_eq!(code(r.resolve("whatever")).0, 503);

        r.set(
            0,
            ModelState::Failed {
                reason: "no such file".into(),
            },
        );
        let (status, c, msg) = code(r.resolve("whatever"));
        assert_eq!((status, c), (404, "model_not_found"));
        assert_eq!(
            msg,
            "The model `whatever` does not exist or you do not have access to it."
        );
        assert_eq!(code(r.resolve("bee")).0, 503);

        r.set(
            1,
            ModelState::Failed {
                reason: "bad magic".into(),
            },
        );
        let (status, _, msg) = code(r.resolve("bee"));
        assert_eq!(status, 503);
        assert!(
            msg.contains("failed to load") && msg.contains("bad magic"),
            "{msg}"
        );
        let why = r.not_ready_reason().unwrap();
        assert!(
            why.contains("a.gguf failed to load: no such file") && why.contains("b.gguf"),
            "{why}"
        );
    }

    #[test]
    fn aliases_are_claimed() {
        let r = ModelRegistry::new(&[spec("a.gguf", None), spec("b.gguf", Some("bee"))]);
        assert!(r.claim_id(0, "a").is_ok());
        let e = r.claim_id(0, "bee").unwrap_err();
        assert!(e.contains("b.gguf"), "{e}");
        assert!(r.claim_id(1, "bee").is_ok());
    }
}
