//! Embeddings: encoder models (BERT family, sentence-transformers layout)
//! on a thread of their own that batches the inputs of every waiting
//! request together, and decoder (chat) models, which embed on their
//! engine thread with last-token pooling when the operator enables it.
//!
//! Batching: the inputs of all requests waiting when the thread is free
//! are sorted by length and cut into batches of at most [`MAX_BATCH_ROWS`]
//! inputs and [`MAX_BATCH_TOKENS`] tokens; a batch's inputs run packed one
//! after another (no padding), so each projection is one GEMM over all of
//! its tokens and attention runs per input.

mod bert;
mod sentence;

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use sentence::{Pooling, SentenceModel};

use mlx_rs::ops::indexing::IndexOp;

use super::model::weights::MlxResult;
use super::model::{self, LoadError};
use super::{EngineError, EngineHandle};
use crate::mlx::kernels::BlasThreads;

/// Rows (inputs) of one encoder batch.
const MAX_BATCH_ROWS: usize = 32;
/// Tokens of one encoder batch (its inputs' lengths summed).
const MAX_BATCH_TOKENS: usize = 8192;
/// Requests waiting for the encoder thread before new ones get 503.
const MAX_QUEUED_REQUESTS: usize = 64;
/// Text a request may tokenize on the serving thread; more goes to a
/// blocking thread.
const TOKENIZE_INLINE_BYTES: usize = 64 * 1024;
/// Inputs the thread takes into one round (requests beyond wait for the next).
const MAX_ROUND_INPUTS: usize = 4096;

/// What an encoder model is, for `/v1/models` and request checks.
#[derive(Debug, Clone)]
pub struct EncoderCard {
    pub id: String,
    pub architecture: String,
    pub dimensions: usize,
    /// Longest input, special tokens included.
    pub max_tokens: usize,
    pub vocab_size: usize,
    pub pooling: Pooling,
    pub normalized: bool,
}

/// One input as a client sends it.
#[derive(Debug, Clone, PartialEq)]
pub enum EmbedInput {
    Text(String),
    /// The text's token ids without special tokens (the model's own are
    /// added around them, so ids embed as their text does).
    Tokens(Vec<u32>),
}

/// The vectors of one request, in input order, and the tokens they took.
#[derive(Debug, Clone)]
pub struct Embeddings {
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: usize,
    /// Inputs cut to the model's length (only with `truncate`).
    pub truncated: usize,
}

type Reply = tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, EngineError>>;

/// A request on its way to the encoder thread: token ids, ready to run.
struct EmbedJob {
    inputs: Vec<Vec<u32>>,
    reply: Reply,
}

/// A running encoder model. Cheap to clone; the thread stops with the last
/// handle, after the work it holds.
#[derive(Clone)]
pub struct EncoderHandle {
    inner: Arc<EncoderInner>,
}

struct EncoderInner {
    card: EncoderCard,
    tokenizer: tokenizers::Tokenizer,
    /// The special tokens the model's template puts before and after a text.
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    queue: Mutex<Option<SyncSender<EmbedJob>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for EncoderInner {
    fn drop(&mut self) {
        if let Ok(mut queue) = self.queue.lock() {
            queue.take();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl EncoderHandle {
    /// Loads the encoder in `dir` on its own thread (MLX ties arrays to the
    /// thread that made them) and starts serving. Blocking.
    pub fn load(dir: &Path) -> Result<EncoderHandle, LoadError> {
        let dir: PathBuf = dir.to_owned();
        let id = model::model_id(&dir);
        let (ready, loaded) = std::sync::mpsc::channel();
        let (queue, jobs) = sync_channel(MAX_QUEUED_REQUESTS);
        let thread = std::thread::Builder::new()
            .name(format!("encoder-{id}"))
            .spawn(move || match SentenceModel::load(&dir) {
                Ok(model) => {
                    let card = EncoderCard {
                        id,
                        architecture: "bert".into(),
                        dimensions: model.encoder.config.hidden_size,
                        max_tokens: model.max_tokens,
                        vocab_size: model.encoder.config.vocab_size,
                        pooling: model.pooling,
                        normalized: model.normalize,
                    };
                    if ready.send(Ok((card, model.tokenizer.clone()))).is_ok() {
                        serve(&model, &jobs);
                    }
                }
                Err(error) => {
                    let _ = ready.send(Err(error));
                }
            })
            .map_err(|e| LoadError::Io(PathBuf::from("encoder thread"), e.to_string()))?;
        let (card, tokenizer) = loaded
            .recv()
            .map_err(|_| LoadError::Mlx("the encoder thread stopped while loading".into()))??;
        let (prefix, suffix) = special_tokens(&tokenizer)?;
        Ok(EncoderHandle {
            inner: Arc::new(EncoderInner {
                card,
                tokenizer,
                prefix,
                suffix,
                queue: Mutex::new(Some(queue)),
                thread: Some(thread),
            }),
        })
    }

    pub fn card(&self) -> &EncoderCard {
        &self.inner.card
    }

    /// A text's token ids, without special tokens.
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.inner
            .tokenizer
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineError::InvalidPrompt(format!("cannot tokenize the input: {e}")))
    }

    /// Queues token ids (special tokens included) and waits for their vectors.
    async fn run(&self, inputs: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>, EngineError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        {
            let queue = self
                .inner
                .queue
                .lock()
                .map_err(|_| EngineError::Unavailable)?;
            let queue = queue.as_ref().ok_or(EngineError::Unavailable)?;
            match queue.try_send(EmbedJob { inputs, reply }) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    return Err(EngineError::Overloaded {
                        waiting: MAX_QUEUED_REQUESTS,
                        retry_after: Duration::from_secs(1),
                    });
                }
                Err(TrySendError::Disconnected(_)) => return Err(EngineError::Unavailable),
            }
        }
        answer.await.map_err(|_| EngineError::Unavailable)?
    }
}

/// The tokens the tokenizer's template adds before and after a text, found
/// by encoding one word with and without them.
fn special_tokens(tokenizer: &tokenizers::Tokenizer) -> Result<(Vec<u32>, Vec<u32>), LoadError> {
    let encode = |special| {
        tokenizer
            .encode_fast("hello", special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| LoadError::Tokenizer(e.to_string()))
    };
    let (plain, full) = (encode(false)?, encode(true)?);
    let at = full
        .windows(plain.len().max(1))
        .position(|w| w == plain.as_slice())
        .ok_or_else(|| LoadError::Tokenizer("cannot find the text inside its template".into()))?;
    Ok((full[..at].to_vec(), full[at + plain.len()..].to_vec()))
}

/// The encoder thread: takes every waiting request, runs their inputs in
/// length-sorted batches, answers each request.
fn serve(model: &SentenceModel, jobs: &Receiver<EmbedJob>) {
    while let Ok(first) = jobs.recv() {
        let mut round = vec![first];
        let mut inputs = round[0].inputs.len();
        while inputs < MAX_ROUND_INPUTS
            && let Ok(next) = jobs.try_recv()
        {
            inputs += next.inputs.len();
            round.push(next);
        }
        // A client that went away needs no vectors.
        round.retain(|job| !job.reply.is_closed());
        // Without the native dense kernel the projections are OpenBLAS
        // GEMMs, which engines on native kernels keep to one thread (their
        // decode does not use it): all cores for the round, ~1.4x on
        // batches of 32.
        let _blas = model.encoder.uses_blas().then(BlasThreads::all_cores);
        run_round(model, round);
    }
}

fn run_round(model: &SentenceModel, round: Vec<EmbedJob>) {
    let mut items: Vec<(usize, usize)> = round
        .iter()
        .enumerate()
        .flat_map(|(j, job)| (0..job.inputs.len()).map(move |i| (j, i)))
        .collect();
    items.sort_by_key(|&(j, i)| round[j].inputs[i].len());
    let mut vectors: Vec<Vec<Vec<f32>>> = round
        .iter()
        .map(|job| vec![Vec::new(); job.inputs.len()])
        .collect();
    let mut failed: Vec<Option<EngineError>> = vec![None; round.len()];
    for batch in batches(&items, |&(j, i)| round[j].inputs[i].len()) {
        let rows: Vec<&[u32]> = batch
            .iter()
            .map(|&(j, i)| round[j].inputs[i].as_slice())
            .collect();
        let mut give_way = GiveWay::new();
        let outcome = super::guarded(|| model.embed(&rows, &mut |x| give_way.after_layer(x)))
            .and_then(|result| result.map_err(|e| e.to_string()));
        match outcome {
            Ok(out) => {
                for (&(j, i), v) in batch.iter().zip(out) {
                    vectors[j][i] = v;
                }
            }
            Err(why) => {
                tracing::error!(error = %why, "embedding batch failed");
                for &(j, _) in batch {
                    failed[j] = Some(EngineError::Internal(format!("embedding failed: {why}")));
                }
            }
        }
    }
    for ((job, out), failure) in round.into_iter().zip(vectors).zip(failed) {
        let _ = job.reply.send(match failure {
            Some(error) => Err(error),
            None => Ok(out),
        });
    }
}

/// Embeddings give way to chat: while a chat engine is generating, the
/// encoder finishes each layer and then rests as long as the layer took, so
/// a stream's next token waits at most about one layer (a few ms to a few
/// tens of ms) and chat keeps about half the machine. Alone, layers stay
/// one lazy graph.
struct GiveWay {
    since: Instant,
}

impl GiveWay {
    /// The longest rest after one layer.
    const MAX_REST: Duration = Duration::from_millis(50);

    fn new() -> GiveWay {
        GiveWay {
            since: Instant::now(),
        }
    }

    fn after_layer(&mut self, x: &mlx_rs::Array) -> MlxResult<()> {
        if !super::chat_is_generating() {
            return Ok(());
        }
        x.eval()?;
        std::thread::sleep(self.since.elapsed().min(Self::MAX_REST));
        self.since = Instant::now();
        Ok(())
    }
}

/// Cuts length-sorted items into batches within the row and token bounds
/// (a single item longer than the token bound is a batch alone).
fn batches<T>(items: &[T], length: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut out = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (end, item) in items.iter().enumerate() {
        let n = length(item);
        if end > start && (end - start == MAX_BATCH_ROWS || tokens + n > MAX_BATCH_TOKENS) {
            out.push(&items[start..end]);
            (start, tokens) = (end, 0);
        }
        tokens += n;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// A model that embeds: an encoder, or a chat model the operator let embed
/// (last-token pooling of its final-normed hidden state, normalized).
#[derive(Clone)]
pub enum Embedder {
    Encoder(EncoderHandle),
    Decoder(EngineHandle),
}

impl Embedder {
    pub fn dimensions(&self) -> usize {
        match self {
            Embedder::Encoder(e) => e.card().dimensions,
            Embedder::Decoder(d) => d.card().hidden_size,
        }
    }

    /// Longest input in tokens (special tokens included).
    pub fn max_tokens(&self) -> usize {
        match self {
            Embedder::Encoder(e) => e.card().max_tokens,
            Embedder::Decoder(d) => d.card().context_length,
        }
    }

    /// Token ids of each input, checked and (with `truncate`) cut to the
    /// model's length, then run together; the error names the input.
    pub async fn embed(
        &self,
        inputs: Vec<EmbedInput>,
        truncate: bool,
    ) -> Result<Embeddings, EngineError> {
        // Tokenizing megabytes of text takes a second or more: off the
        // serving thread, whose other connections would wait meanwhile.
        let text_bytes: usize = inputs
            .iter()
            .map(|i| match i {
                EmbedInput::Text(text) => text.len(),
                EmbedInput::Tokens(_) => 0,
            })
            .sum();
        let (ids, truncated) = if text_bytes > TOKENIZE_INLINE_BYTES {
            let embedder = self.clone();
            tokio::task::spawn_blocking(move || embedder.prepare_all(inputs, truncate))
                .await
                .map_err(|e| EngineError::Internal(format!("tokenizing failed: {e}")))??
        } else {
            self.prepare_all(inputs, truncate)?
        };
        let prompt_tokens = ids.iter().map(Vec::len).sum();
        let vectors = match self {
            Embedder::Encoder(e) => e.run(ids).await?,
            Embedder::Decoder(d) => d.embed_last_token(ids).await?,
        };
        Ok(Embeddings {
            vectors,
            prompt_tokens,
            truncated,
        })
    }

    /// Every input's ids and how many were cut; the error names the input.
    fn prepare_all(
        &self,
        inputs: Vec<EmbedInput>,
        truncate: bool,
    ) -> Result<(Vec<Vec<u32>>, usize), EngineError> {
        let mut truncated = 0;
        let mut ids = Vec::with_capacity(inputs.len());
        for (index, input) in inputs.into_iter().enumerate() {
            let (tokens, cut) = self.prepare(input, truncate).map_err(|e| match e {
                EngineError::InvalidPrompt(why) => {
                    EngineError::InvalidPrompt(format!("input[{index}]: {why}"))
                }
                other => other,
            })?;
            truncated += cut as usize;
            ids.push(tokens);
        }
        Ok((ids, truncated))
    }

    /// One input's ids, special tokens included, and whether it was cut.
    fn prepare(&self, input: EmbedInput, truncate: bool) -> Result<(Vec<u32>, bool), EngineError> {
        let (vocab, (prefix, suffix)) = match self {
            Embedder::Encoder(e) => (
                e.card().vocab_size,
                (e.inner.prefix.as_slice(), e.inner.suffix.as_slice()),
            ),
            Embedder::Decoder(d) => (d.card().vocab_size, (&[][..], &[][..])),
        };
        let content = match input {
            EmbedInput::Text(text) if text.is_empty() => {
                return Err(EngineError::InvalidPrompt(
                    "the input is an empty string; send at least one character".into(),
                ));
            }
            EmbedInput::Text(text) => match self {
                Embedder::Encoder(e) => e.tokenize(&text)?,
                Embedder::Decoder(d) => d.tokenize(&text)?,
            },
            EmbedInput::Tokens(ids) => {
                if ids.is_empty() {
                    return Err(EngineError::InvalidPrompt(
                        "the input is an empty array of token ids".into(),
                    ));
                }
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(EngineError::InvalidPrompt(format!(
                        "token id {bad} is outside the model's vocabulary (ids 0 to {})",
                        vocab - 1
                    )));
                }
                ids
            }
        };
        let room = self
            .max_tokens()
            .saturating_sub(prefix.len() + suffix.len());
        let cut = content.len() > room;
        if cut && !truncate {
            return Err(EngineError::InvalidPrompt(format!(
                "the input is {} tokens, over the model's limit of {} ({} with special tokens); shorten it, or send `\"truncate\": true` to embed its first {room} tokens",
                content.len() + prefix.len() + suffix.len(),
                self.max_tokens(),
                prefix.len() + suffix.len(),
            )));
        }
        let mut ids = prefix.to_vec();
        ids.extend_from_slice(&content[..content.len().min(room)]);
        ids.extend_from_slice(suffix);
        Ok((ids, cut))
    }
}

/// Each input's final-normed hidden state at its last position, through
/// the decoder's full forward (causal, so that position has seen the whole
/// input), L2-normalized. Runs on the model's engine thread.
pub(super) fn last_token_embeddings(
    model: &model::Transformer,
    inputs: &[Vec<u32>],
) -> MlxResult<Vec<Vec<f32>>> {
    inputs
        .iter()
        .map(|ids| {
            let tokens = mlx_rs::Array::from_slice(ids, &[1, ids.len() as i32]);
            let states = model.forward_hidden_with(&tokens, &|y, _, _, _| Ok(y))?;
            let last = states
                .index((0, ids.len() as i32 - 1))
                .as_dtype(mlx_rs::Dtype::Float32)?;
            last.eval()?;
            Ok(Pooling::LastToken.pool(last.as_slice::<f32>(), last.size(), true))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_keep_rows_and_tokens_within_bounds() {
        let lengths: Vec<usize> = (0..40).map(|_| 10).chain([300; 30]).chain([9000]).collect();
        let cut = batches(&lengths, |&n| n);
        let sizes: Vec<usize> = cut.iter().map(|b| b.len()).collect();
        // 32 short rows; the other 8 with 18 long ones (8 x 10 + 18 x 300
        // + the next 300 would pass 8192 tokens... 8 x 10 + 27 x 300 does);
        // the rest; the oversized input alone.
        assert_eq!(sizes.iter().sum::<usize>(), lengths.len());
        assert_eq!(sizes[0], MAX_BATCH_ROWS);
        for batch in &cut {
            let tokens: usize = batch.iter().sum();
            assert!(batch.len() <= MAX_BATCH_ROWS, "{batch:?}");
            assert!(batch.len() == 1 || tokens <= MAX_BATCH_TOKENS, "{batch:?}");
        }
        assert_eq!(cut.last().unwrap(), &[9000]);
        assert!(batches(&[] as &[usize], |&n| n).is_empty());
    }
}
