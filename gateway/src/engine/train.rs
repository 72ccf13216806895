//! LoRA fine-tuning (SFT) on a frozen base model, quantized or not, with
//! MLX autograd: the trainable parameters are the LoRA factors only.
//!
//! - Data: JSONL records in one of three formats — chat `messages` (rendered
//!   with the model's chat template), `prompt`/`completion` (a user turn and
//!   an assistant turn through the template; plain concatenation for models
//!   without one) and `text`. With `mask_prompt` (the default) the loss only
//!   counts completion tokens.
//! - Model: `y + scale * (dropout(x) A) B` on every targeted projection of
//!   the last `num_layers` blocks, as mlx-lm's `LoRALinear`; A starts uniform
//!   in ±1/sqrt(in), B at zero, so step 0 is the base model.
//! - Loss: mean cross-entropy over the counted tokens of a right-padded
//!   batch; logits are computed for those positions only (the same value as
//!   masking full logits, for less work).
//! - Optimiser: mlx-rs `AdamW` (no bias correction, like MLX), learning rate
//!   with linear warmup then cosine decay, gradient accumulation, global
//!   gradient norm (optional clipping).
//! - Batching: examples sorted by length and cut into batches; each epoch
//!   visits the batches in an order drawn from `(seed, epoch)`, so batch `s`
//!   is a pure function of the seed and the step and a resumed run sees the
//!   same data as an uninterrupted one. Dropout keys come from
//!   `(seed, step)` too.
//! - Output: mlx-lm's adapter format (`adapters.safetensors` with
//!   `model.layers.N.<module>.lora_a` `[in, r]` / `lora_b` `[r, out]`, and
//!   `adapter_config.json` with `fine_tune_type`, `num_layers`,
//!   `lora_parameters` and the base model), which [`super::lora::load`] and
//!   mlx-lm both read. A checkpoint is such a directory plus the optimiser
//!   state and `trainer_state.json`.
//!
//! MLX arrays belong to the thread that made them: build, train and save a
//! [`Trainer`] on one thread.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use mlx_rs::Array;
use mlx_rs::ops::{add, matmul, multiply};
use mlx_rs::optimizers::{AdamW, Optimizer};
use mlx_rs::transforms::value_and_grad_with_argnums;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::api::ChatMessage;
use super::lora::Projection;
use super::model::Transformer;
use super::model::weights::MlxResult;
use super::text::TextCodec;

/// Why training could not go on; each message says what is wrong.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum TrainError {
    #[error("{0}")]
    Data(String),
    #[error("{0}")]
    Checkpoint(String),
    #[error("MLX: {0}")]
    Mlx(String),
}

impl From<mlx_rs::error::Exception> for TrainError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        TrainError::Mlx(e.to_string())
    }
}

/// The LoRA shape: what `adapter_config.json`'s `lora_parameters` records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraSettings {
    pub rank: usize,
    /// Multiplies the residual (mlx-lm's `scale`; PEFT's alpha / rank).
    pub scale: f32,
    pub dropout: f32,
    /// Projections that get factors, in every adapted block.
    #[serde(with = "projection_names")]
    pub keys: Vec<Projection>,
    /// The last `num_layers` blocks are adapted.
    pub num_layers: usize,
}

/// Projections as their module paths (`self_attn.q_proj`), or the last
/// part (`q_proj`) when reading.
pub fn projection_from_name(name: &str) -> Option<Projection> {
    Projection::ALL
        .into_iter()
        .find(|p| p.module() == name || p.module().rsplit('.').next() == Some(name))
}

mod projection_names {
    use super::{Projection, projection_from_name};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(keys: &[Projection], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(keys.iter().map(|p| p.module()))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Projection>, D::Error> {
        let names = Vec::<String>::deserialize(d)?;
        names
            .iter()
            .map(|n| {
                projection_from_name(n)
                    .ok_or_else(|| serde::de::Error::custom(format!("unknown projection `{n}`")))
            })
            .collect()
    }
}

impl Default for LoraSettings {
    fn default() -> Self {
        LoraSettings {
            rank: 8,
            scale: 20.0,
            dropout: 0.0,
            keys: Projection::ALL.to_vec(),
            num_layers: 16,
        }
    }
}

/// Everything a run depends on besides the model and the data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSettings {
    pub lora: LoraSettings,
    pub learning_rate: f64,
    /// Linear warmup from 0 over this many steps.
    pub warmup_steps: usize,
    /// Cosine decay ends at `learning_rate * min_lr_ratio`.
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    pub batch_size: usize,
    pub max_seq_len: usize,
    /// Optimiser steps.
    pub iterations: usize,
    /// Micro-batches per optimiser step.
    pub grad_accumulation: usize,
    /// Clip the global gradient norm to this (none when 0).
    pub max_grad_norm: f64,
    pub seed: u64,
    /// Count only completion tokens in the loss.
    pub mask_prompt: bool,
    /// Validation batches per evaluation (0: the whole split).
    pub val_batches: usize,
}

impl Default for TrainSettings {
    fn default() -> Self {
        TrainSettings {
            lora: LoraSettings::default(),
            learning_rate: 1e-5,
            warmup_steps: 0,
            min_lr_ratio: 0.0,
            weight_decay: 0.01,
            batch_size: 4,
            max_seq_len: 2048,
            iterations: 1000,
            grad_accumulation: 1,
            max_grad_norm: 0.0,
            seed: 0,
            mask_prompt: true,
            val_batches: 25,
        }
    }
}

impl TrainSettings {
    /// The learning rate of optimiser step `step` (0-based): linear warmup,
    /// then cosine decay to `min_lr_ratio * learning_rate` at the last step.
    pub fn learning_rate_at(&self, step: usize) -> f64 {
        let peak = self.learning_rate;
        if step < self.warmup_steps {
            return peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let decay = self.iterations.saturating_sub(self.warmup_steps).max(1) as f64;
        let t = ((step - self.warmup_steps) as f64 / decay).min(1.0);
        let floor = peak * self.min_lr_ratio;
        floor + 0.5 * (peak - floor) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

// ---------------------------------------------------------------- data

/// One tokenized example: the loss counts `tokens[prompt_len..]` as targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
}

/// Reads a JSONL file: one JSON object per non-empty line.
pub fn read_jsonl(path: &Path) -> Result<Vec<Value>, TrainError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TrainError::Data(format!("cannot read {}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| {
            TrainError::Data(format!("{} line {}: not JSON: {e}", path.display(), i + 1))
        })?;
        if !v.is_object() {
            return Err(TrainError::Data(format!(
                "{} line {}: not a JSON object",
                path.display(),
                i + 1
            )));
        }
        out.push(v);
    }
    Ok(out)
}

fn text_field<'a>(record: &'a Value, key: &str) -> Result<&'a str, String> {
    record
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("`{key}` must be a string"))
}

/// Tokenizes one record (`messages`, `prompt`/`completion` or `text`).
pub fn encode_record(
    codec: &TextCodec,
    record: &Value,
    mask_prompt: bool,
) -> Result<Example, String> {
    let (tokens, prompt_len) = if let Some(messages) = record.get("messages") {
        let list = messages
            .as_array()
            .ok_or("`messages` must be an array of {role, content}")?;
        let mut chat = Vec::with_capacity(list.len());
        for m in list {
            chat.push(ChatMessage {
                role: text_field(m, "role")?.to_owned(),
                content: text_field(m, "content")?.to_owned(),
            });
        }
        if chat.is_empty() {
            return Err("`messages` is empty".into());
        }
        chat_example(codec, &chat)?
    } else if let Some(prompt) = record.get("prompt") {
        let prompt = prompt.as_str().ok_or("`prompt` must be a string")?;
        let completion = text_field(record, "completion")?;
        let chat = [
            ChatMessage {
                role: "user".into(),
                content: prompt.to_owned(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: completion.to_owned(),
            },
        ];
        match chat_example(codec, &chat) {
            Ok(pair) => pair,
            Err(_) => {
                // No chat template: the plain text of both.
                let p = codec.encode(prompt)?;
                let mut all = codec.encode(&format!("{prompt}{completion}"))?;
                push_eos(codec, &mut all);
                let shared = p.iter().zip(&all).take_while(|(a, b)| a == b).count();
                (all, shared)
            }
        }
    } else if record.get("text").is_some() {
        let mut all = codec.encode(text_field(record, "text")?)?;
        push_eos(codec, &mut all);
        (all, 0)
    } else {
        return Err("a record needs `messages`, `prompt` and `completion`, or `text`".into());
    };
    if tokens.len() < 2 {
        return Err("the record has fewer than two tokens".into());
    }
    Ok(Example {
        prompt_len: if mask_prompt {
            prompt_len.min(tokens.len() - 1)
        } else {
            0
        },
        tokens,
    })
}

fn push_eos(codec: &TextCodec, tokens: &mut Vec<u32>) {
    if let Some(&eos) = codec.eos_ids.first()
        && tokens.last() != Some(&eos)
    {
        tokens.push(eos);
    }
}

/// The whole conversation and the length of its part before the last
/// assistant turn (with that turn's opening), as mlx-lm's `ChatDataset`.
fn chat_example(codec: &TextCodec, chat: &[ChatMessage]) -> Result<(Vec<u32>, usize), String> {
    let full = codec.encode(&codec.render_chat_with(chat, false)?)?;
    let last_is_assistant = chat.last().is_some_and(|m| m.role == "assistant");
    let prompt_len = if last_is_assistant {
        let prompt = codec.encode(&codec.render_chat_with(&chat[..chat.len() - 1], true)?)?;
        prompt.iter().zip(&full).take_while(|(a, b)| a == b).count()
    } else {
        0
    };
    Ok((full, prompt_len))
}

/// A tokenized split and what was dropped or cut while reading it.
#[derive(Debug, Default)]
pub struct Split {
    pub examples: Vec<Example>,
    /// Examples longer than `max_seq_len`, cut to it.
    pub truncated: usize,
}

/// Reads and tokenizes `path` (JSONL). A record that cannot be read is an
/// error naming its line.
pub fn load_split(
    path: &Path,
    codec: &TextCodec,
    settings: &TrainSettings,
) -> Result<Split, TrainError> {
    let mut split = Split::default();
    for (i, record) in read_jsonl(path)?.iter().enumerate() {
        let mut ex = encode_record(codec, record, settings.mask_prompt)
            .map_err(|e| TrainError::Data(format!("{} record {}: {e}", path.display(), i + 1)))?;
        if ex.tokens.len() > settings.max_seq_len {
            ex.tokens.truncate(settings.max_seq_len.max(2));
            split.truncated += 1;
        }
        if ex.prompt_len >= ex.tokens.len() - 1 && settings.mask_prompt {
            // Nothing left to learn from after the cut.
            continue;
        }
        split.examples.push(ex);
    }
    if split.examples.is_empty() {
        return Err(TrainError::Data(format!(
            "{} has no usable examples",
            path.display()
        )));
    }
    Ok(split)
}

/// SplitMix64: a tiny seeded generator for batch orders.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut g = SplitMix(seed ^ a.wrapping_mul(0x9E37_79B9) ^ b.rotate_left(32));
    g.next()
}

/// Batches of example indices, sorted by length so padding stays small.
fn make_batches(examples: &[Example], batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..examples.len()).collect();
    order.sort_by_key(|&i| (examples[i].tokens.len(), i));
    order
        .chunks(batch_size.max(1))
        .map(<[usize]>::to_vec)
        .collect()
}

/// One padded batch as MLX inputs: token ids `[B, L-1]`, and the flat
/// positions (into `B * (L-1)`) and labels of the counted targets.
struct Batch {
    inputs: Array,
    positions: Array,
    labels: Array,
    /// Counted target tokens.
    targets: usize,
    /// Non-padding input tokens.
    tokens: usize,
}

fn build_batch(examples: &[&Example]) -> Batch {
    let width = examples.iter().map(|e| e.tokens.len()).max().unwrap_or(2) - 1;
    let mut inputs = Vec::with_capacity(examples.len() * width);
    let (mut positions, mut labels) = (Vec::new(), Vec::new());
    let mut tokens = 0;
    for (b, e) in examples.iter().enumerate() {
        let n = e.tokens.len() - 1;
        tokens += n;
        inputs.extend_from_slice(&e.tokens[..n]);
        inputs.extend(std::iter::repeat_n(0u32, width - n));
        // Target t (predicting tokens[t + 1]) counts when t + 1 >= prompt_len.
        for t in e.prompt_len.saturating_sub(1)..n {
            positions.push((b * width + t) as u32);
            labels.push(e.tokens[t + 1]);
        }
    }
    let targets = labels.len();
    Batch {
        inputs: Array::from_slice(&inputs, &[examples.len() as i32, width as i32]),
        positions: Array::from_slice(&positions, &[targets as i32]),
        labels: Array::from_slice(&labels, &[targets as i32, 1]),
        targets,
        tokens,
    }
}

// ---------------------------------------------------------------- LoRA

/// The trainable factors: per adapted `(layer, projection)`, A `[in, r]`
/// and B `[r, out]` (float32), kept flat as `[a0, b0, a1, b1, ...]`.
pub struct LoraTrainable {
    pub settings: LoraSettings,
    pub targets: Vec<(usize, Projection)>,
    pub params: Vec<Array>,
    index: HashMap<(usize, Projection), usize>,
}

/// The tensor name mlx-lm gives a factor.
pub fn factor_name(layer: usize, projection: Projection, a: bool) -> String {
    format!(
        "model.layers.{layer}.{}.lora_{}",
        projection.module(),
        if a { "a" } else { "b" }
    )
}

impl LoraTrainable {
    /// Fresh factors for the last `num_layers` blocks of `model`: A uniform
    /// in ±1/sqrt(in) from `seed`, B zero.
    pub fn init(
        model: &Transformer,
        settings: LoraSettings,
        seed: u64,
    ) -> Result<LoraTrainable, TrainError> {
        let dims = model.lora_targets();
        let layers = model.config.layers;
        if settings.num_layers == 0 || settings.num_layers > layers {
            return Err(TrainError::Data(format!(
                "num_layers {} must be in 1..={layers} for this model",
                settings.num_layers
            )));
        }
        let mut targets = Vec::new();
        let mut params = Vec::new();
        let r = settings.rank as i32;
        for layer in layers - settings.num_layers..layers {
            for &projection in &settings.keys {
                let (input, output) = dims[&(layer, projection)];
                let bound = 1.0 / (input as f32).sqrt();
                let key = mlx_rs::random::key(mix(seed, layer as u64, projection as u64))?;
                let a =
                    mlx_rs::random::uniform::<_, f32>(-bound, bound, &[input as i32, r][..], &key)?;
                let b = mlx_rs::ops::zeros::<f32>(&[r, output as i32])?;
                targets.push((layer, projection));
                params.push(a);
                params.push(b);
            }
        }
        mlx_rs::transforms::eval(params.iter())?;
        Ok(LoraTrainable::from_parts(settings, targets, params))
    }

    fn from_parts(
        settings: LoraSettings,
        targets: Vec<(usize, Projection)>,
        params: Vec<Array>,
    ) -> LoraTrainable {
        let index = targets.iter().enumerate().map(|(i, t)| (*t, i)).collect();
        LoraTrainable {
            settings,
            targets,
            params,
            index,
        }
    }

    /// Tensor names in `params` order.
    pub fn names(&self) -> Vec<String> {
        self.targets
            .iter()
            .flat_map(|&(l, p)| [factor_name(l, p, true), factor_name(l, p, false)])
            .collect()
    }

    /// Trainable parameter count.
    pub fn parameter_count(&self) -> usize {
        self.params.iter().map(Array::size).sum()
    }

    /// `y + scale * (dropout(x) A) B` for `(layer, projection)` with the
    /// factors in `params` (the autograd arguments), `y` unchanged elsewhere.
    fn residual(
        &self,
        params: &[Array],
        y: Array,
        x: &Array,
        layer: usize,
        projection: Projection,
        dropout_key: Option<u64>,
    ) -> MlxResult<Array> {
        let Some(&i) = self.index.get(&(layer, projection)) else {
            return Ok(y);
        };
        let p = self.settings.dropout;
        let x = match dropout_key {
            Some(seed) if p > 0.0 => {
                let key = mlx_rs::random::key(mix(seed, layer as u64, projection as u64))?;
                let keep = mlx_rs::random::bernoulli(&Array::from_f32(1.0 - p), x.shape(), &key)?;
                let kept = mlx_rs::ops::select(&keep, x, Array::from_f32(0.0))?;
                multiply(&kept, Array::from_f32(1.0 / (1.0 - p)))?
            }
            _ => x.clone(),
        };
        let z = matmul(&matmul(&x, &params[2 * i])?, &params[2 * i + 1])?;
        add(&y, &multiply(&z, Array::from_f32(self.settings.scale))?)
    }

    /// Writes `adapters.safetensors` and `adapter_config.json` (mlx-lm's
    /// format, recording `base_model`) into `dir`, which must exist.
    pub fn save(&self, dir: &Path, base_model: &str) -> Result<(), TrainError> {
        let io =
            |what: &str, e: String| TrainError::Checkpoint(format!("cannot write {what}: {e}"));
        let tensors: HashMap<String, &Array> = self.names().into_iter().zip(&self.params).collect();
        let metadata = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
        Array::save_safetensors(tensors, &metadata, dir.join("adapters.safetensors"))
            .map_err(|e| io("adapters.safetensors", e.to_string()))?;
        let keys: Vec<&str> = self.settings.keys.iter().map(|p| p.module()).collect();
        let config = json!({
            "fine_tune_type": "lora",
            "num_layers": self.settings.num_layers,
            "lora_parameters": {
                "rank": self.settings.rank,
                "scale": self.settings.scale,
                "dropout": self.settings.dropout,
                "keys": keys,
            },
            "model": base_model,
            "base_model": base_model,
            "trained_with": "mlxgate",
        });
        let text = serde_json::to_string_pretty(&config).unwrap_or_default();
        std::fs::write(dir.join("adapter_config.json"), text)
            .map_err(|e| io("adapter_config.json", e.to_string()))
    }

    /// Reads factors written by [`LoraTrainable::save`] for `model` (to
    /// resume): every expected tensor must be there with the right shape.
    pub fn load(
        dir: &Path,
        model: &Transformer,
        settings: LoraSettings,
    ) -> Result<LoraTrainable, TrainError> {
        let fresh = LoraTrainable::init(model, settings, 0)?;
        let path = dir.join("adapters.safetensors");
        let mut tensors = Array::load_safetensors(&path)
            .map_err(|e| TrainError::Checkpoint(format!("cannot read {}: {e}", path.display())))?;
        let mut params = Vec::with_capacity(fresh.params.len());
        for (name, want) in fresh.names().iter().zip(&fresh.params) {
            let got = tensors.remove(name).ok_or_else(|| {
                TrainError::Checkpoint(format!("{}: `{name}` is missing", path.display()))
            })?;
            if got.shape() != want.shape() {
                return Err(TrainError::Checkpoint(format!(
                    "{}: `{name}` has shape {:?}, expected {:?}",
                    path.display(),
                    got.shape(),
                    want.shape()
                )));
            }
            params.push(got.as_dtype(mlx_rs::Dtype::Float32)?);
        }
        mlx_rs::transforms::eval(params.iter())?;
        Ok(LoraTrainable::from_parts(
            fresh.settings,
            fresh.targets,
            params,
        ))
    }
}

// ---------------------------------------------------------------- loss

/// Mean cross-entropy of the counted targets of `batch`, with the LoRA
/// factors `params`.
fn batch_loss(
    model: &Transformer,
    lora: &LoraTrainable,
    params: &[Array],
    batch: &Batch,
    dropout_key: Option<u64>,
) -> MlxResult<Array> {
    let hidden = model.forward_hidden_with(&batch.inputs, &|y, x, layer, projection| {
        lora.residual(params, y, x, layer, projection, dropout_key)
    })?;
    let width = hidden.dim(-1);
    let picked = hidden
        .reshape(&[-1, width])?
        .take_axis(&batch.positions, 0)?;
    let logits = model.logits_of_hidden(&picked)?;
    let lse = logits.logsumexp_axis(-1, true)?;
    let target = logits.take_along_axis(&batch.labels, -1)?;
    let ce = mlx_rs::ops::subtract(&lse, &target)?;
    ce.mean(None)
}

// ---------------------------------------------------------------- trainer

/// What one optimiser step did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    /// 1-based: the number of optimiser steps done.
    pub step: usize,
    pub loss: f64,
    pub grad_norm: f64,
    pub learning_rate: f64,
    /// Counted (loss) tokens of this step.
    pub trained_tokens: usize,
    /// Non-padding input tokens of this step.
    pub input_tokens: usize,
    pub seconds: f64,
}

/// What a checkpoint records besides the arrays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: usize,
    pub settings: TrainSettings,
    /// Fingerprint of the run's inputs (model, data), to refuse resuming
    /// another run's checkpoint.
    pub run: String,
    pub trained_tokens: u64,
    pub input_tokens: u64,
    pub train_seconds: f64,
    /// `[step, loss]` of each reported validation.
    #[serde(default)]
    pub val_losses: Vec<(usize, f64)>,
}

/// A LoRA training run on one model (one thread).
pub struct Trainer<'m> {
    model: &'m Transformer,
    pub settings: TrainSettings,
    pub lora: LoraTrainable,
    optimizer: AdamW,
    train: Vec<Example>,
    valid: Vec<Example>,
    batches: Vec<Vec<usize>>,
    pub state: TrainerState,
}

impl<'m> Trainer<'m> {
    /// A fresh run. `run` fingerprints its inputs (recorded in checkpoints).
    pub fn new(
        model: &'m Transformer,
        settings: TrainSettings,
        train: Vec<Example>,
        valid: Vec<Example>,
        run: String,
    ) -> Result<Trainer<'m>, TrainError> {
        if train.is_empty() {
            return Err(TrainError::Data("no training examples".into()));
        }
        let lora = LoraTrainable::init(model, settings.lora.clone(), settings.seed)?;
        let optimizer = AdamW::new(settings.learning_rate as f32);
        let mut optimizer = optimizer;
        optimizer.weight_decay = Array::from_f32(settings.weight_decay as f32);
        let batches = make_batches(&train, settings.batch_size);
        Ok(Trainer {
            model,
            state: TrainerState {
                step: 0,
                settings: settings.clone(),
                run,
                trained_tokens: 0,
                input_tokens: 0,
                train_seconds: 0.0,
                val_losses: Vec::new(),
            },
            settings,
            lora,
            optimizer,
            train,
            valid,
            batches,
        })
    }

    /// Training examples (after tokenizing), validation examples.
    pub fn sizes(&self) -> (usize, usize) {
        (self.train.len(), self.valid.len())
    }

    /// The training batch of micro-step `micro` (global count).
    fn train_batch(&self, micro: usize) -> Batch {
        let n = self.batches.len();
        let (epoch, at) = (micro / n, micro % n);
        // A seeded permutation per epoch (Fisher-Yates).
        let mut order: Vec<usize> = (0..n).collect();
        let mut g = SplitMix(mix(self.settings.seed, 0xE90C, epoch as u64));
        for i in (1..n).rev() {
            let j = (g.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let picked: Vec<&Example> = self.batches[order[at]]
            .iter()
            .map(|&i| &self.train[i])
            .collect();
        build_batch(&picked)
    }

    /// One optimiser step (with its gradient accumulation).
    pub fn step(&mut self) -> Result<StepReport, TrainError> {
        let started = Instant::now();
        let step = self.state.step;
        let accumulation = self.settings.grad_accumulation.max(1);
        let argnums: Vec<i32> = (0..self.lora.params.len() as i32).collect();
        let mut summed: Option<Vec<Array>> = None;
        let (mut loss_sum, mut trained, mut input) = (0.0f64, 0usize, 0usize);
        for k in 0..accumulation {
            let micro = step * accumulation + k;
            let batch = self.train_batch(micro);
            let dropout_key = Some(mix(self.settings.seed, 0xD80, micro as u64));
            let (model, lora) = (self.model, &self.lora);
            let f = |params: &[Array]| -> MlxResult<Vec<Array>> {
                Ok(vec![batch_loss(model, lora, params, &batch, dropout_key)?])
            };
            let mut vg = value_and_grad_with_argnums(f, &argnums[..]);
            let (values, grads) = vg(&self.lora.params)?;
            let mut arrays: Vec<&Array> = grads.iter().collect();
            arrays.push(&values[0]);
            mlx_rs::transforms::eval(arrays)?;
            loss_sum += f64::from(values[0].item_exact::<f32>());
            trained += batch.targets;
            input += batch.tokens;
            summed = Some(match summed {
                None => grads,
                Some(prev) => prev
                    .iter()
                    .zip(&grads)
                    .map(|(a, b)| add(a, b))
                    .collect::<MlxResult<Vec<_>>>()?,
            });
        }
        let mut grads = summed.unwrap_or_default();
        if accumulation > 1 {
            let inv = Array::from_f32(1.0 / accumulation as f32);
            grads = grads
                .iter()
                .map(|g| multiply(g, &inv))
                .collect::<MlxResult<_>>()?;
        }
        let mut norm2 = Array::from_f32(0.0);
        for g in &grads {
            norm2 = add(&norm2, &g.square()?.sum(None)?)?;
        }
        let grad_norm = f64::from(norm2.sqrt()?.item_exact::<f32>());
        if self.settings.max_grad_norm > 0.0 && grad_norm > self.settings.max_grad_norm {
            let factor = Array::from_f32((self.settings.max_grad_norm / grad_norm) as f32);
            grads = grads
                .iter()
                .map(|g| multiply(g, &factor))
                .collect::<MlxResult<_>>()?;
        }
        let learning_rate = self.settings.learning_rate_at(step);
        self.optimizer.lr = Array::from_f32(learning_rate as f32);
        let names: Vec<Rc<str>> = self.lora.names().into_iter().map(Rc::from).collect();
        for ((name, g), p) in names.iter().zip(&grads).zip(self.lora.params.iter_mut()) {
            self.optimizer.update_single(name, g, p)?;
        }
        let mut live: Vec<&Array> = self.lora.params.iter().collect();
        for (m, v) in self.optimizer.state.values() {
            live.push(m);
            live.push(v);
        }
        mlx_rs::transforms::eval(live)?;
        let seconds = started.elapsed().as_secs_f64();
        self.state.step += 1;
        self.state.trained_tokens += trained as u64;
        self.state.input_tokens += input as u64;
        self.state.train_seconds += seconds;
        Ok(StepReport {
            step: self.state.step,
            loss: loss_sum / accumulation as f64,
            grad_norm,
            learning_rate,
            trained_tokens: trained,
            input_tokens: input,
            seconds,
        })
    }

    /// Mean loss over the validation split (the first `val_batches`
    /// batches; every counted token weighs the same). `None` without one.
    pub fn validate(&self) -> Result<Option<f64>, TrainError> {
        if self.valid.is_empty() {
            return Ok(None);
        }
        let mut batches = make_batches(&self.valid, self.settings.batch_size);
        if self.settings.val_batches > 0 {
            batches.truncate(self.settings.val_batches);
        }
        let (mut total, mut count) = (0.0f64, 0usize);
        for indices in batches {
            let picked: Vec<&Example> = indices.iter().map(|&i| &self.valid[i]).collect();
            let batch = build_batch(&picked);
            if batch.targets == 0 {
                continue;
            }
            let loss = batch_loss(self.model, &self.lora, &self.lora.params, &batch, None)?;
            total += f64::from(loss.item_exact::<f32>()) * batch.targets as f64;
            count += batch.targets;
        }
        Ok((count > 0).then(|| total / count as f64))
    }

    /// Writes the adapter (mlx-lm format) into `dir`, created if needed.
    pub fn save_adapter(&self, dir: &Path, base_model: &str) -> Result<(), TrainError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| TrainError::Checkpoint(format!("cannot create {}: {e}", dir.display())))?;
        self.lora.save(dir, base_model)
    }

    /// Writes a resumable checkpoint to `dir` (replaced atomically): the
    /// adapter, the optimiser moments and `trainer_state.json`.
    pub fn save_checkpoint(&self, dir: &Path, base_model: &str) -> Result<(), TrainError> {
        let io = |e: String| TrainError::Checkpoint(e);
        let tmp = sibling(dir, ".tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        self.save_adapter(&tmp, base_model)?;
        let mut moments: HashMap<String, &Array> = HashMap::new();
        for (key, (m, v)) in &self.optimizer.state {
            moments.insert(format!("{key}.m"), m);
            moments.insert(format!("{key}.v"), v);
        }
        Array::save_safetensors(moments, None, tmp.join("optimizer.safetensors"))
            .map_err(|e| io(format!("cannot write optimizer.safetensors: {e}")))?;
        let state = serde_json::to_string_pretty(&self.state).unwrap_or_default();
        std::fs::write(tmp.join("trainer_state.json"), state)
            .map_err(|e| io(format!("cannot write trainer_state.json: {e}")))?;
        let old = sibling(dir, ".old");
        let _ = std::fs::remove_dir_all(&old);
        if dir.exists() {
            std::fs::rename(dir, &old)
                .map_err(|e| io(format!("cannot replace checkpoint: {e}")))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| io(format!("cannot move checkpoint: {e}")))?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    /// Continues from the checkpoint in `dir`, which must come from a run
    /// with the same settings and inputs.
    pub fn resume(&mut self, dir: &Path) -> Result<(), TrainError> {
        let state = read_checkpoint_state(dir)?;
        if state.run != self.state.run {
            return Err(TrainError::Checkpoint(format!(
                "the checkpoint in {} comes from another model or dataset",
                dir.display()
            )));
        }
        if state.settings != self.settings {
            return Err(TrainError::Checkpoint(format!(
                "the checkpoint in {} was made with other training settings",
                dir.display()
            )));
        }
        let lora = LoraTrainable::load(dir, self.model, self.settings.lora.clone())?;
        let path = dir.join("optimizer.safetensors");
        let mut moments = Array::load_safetensors(&path)
            .map_err(|e| TrainError::Checkpoint(format!("cannot read {}: {e}", path.display())))?;
        let mut opt_state = mlx_rs::optimizers::State::<(Array, Array)>::new();
        if state.step > 0 {
            for name in lora.names() {
                let (Some(m), Some(v)) = (
                    moments.remove(&format!("{name}.m")),
                    moments.remove(&format!("{name}.v")),
                ) else {
                    return Err(TrainError::Checkpoint(format!(
                        "{}: optimiser state of `{name}` is missing",
                        path.display()
                    )));
                };
                opt_state.insert(Rc::from(name.as_str()), (m, v));
            }
        }
        self.lora = lora;
        self.optimizer.state = opt_state;
        self.state = state;
        Ok(())
    }
}

/// Reads a checkpoint's `trainer_state.json`.
pub fn read_checkpoint_state(dir: &Path) -> Result<TrainerState, TrainError> {
    let path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| TrainError::Checkpoint(format!("cannot read {}: {e}", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.with_file_name(format!("{name}{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = TrainSettings {
            learning_rate: 1.0,
            warmup_steps: 4,
            iterations: 14,
            min_lr_ratio: 0.1,
            ..TrainSettings::default()
        };
        assert!((s.learning_rate_at(0) - 0.25).abs() < 1e-9);
        assert!((s.learning_rate_at(3) - 1.0).abs() < 1e-9);
        assert!((s.learning_rate_at(4) - 1.0).abs() < 1e-9);
        assert!((s.learning_rate_at(9) - 0.55).abs() < 1e-9);
        assert!((s.learning_rate_at(14) - 0.1).abs() < 1e-9);
    }

    #[test]
    fn batches_count_only_completion_targets() {
        let a = Example {
            tokens: vec![1, 2, 3, 4, 5],
            prompt_len: 3,
        };
        let b = Example {
            tokens: vec![7, 8, 9],
            prompt_len: 0,
        };
        let batch = build_batch(&[&a, &b]);
        assert_eq!(batch.inputs.shape(), &[2, 4]);
        // a: targets 4, 5 at positions 2, 3; b: 8, 9 at 4 + 0, 4 + 1.
        assert_eq!(batch.positions.as_slice::<u32>(), &[2, 3, 4, 5]);
        assert_eq!(batch.labels.as_slice::<u32>(), &[4, 5, 8, 9]);
        assert_eq!((batch.targets, batch.tokens), (4, 6));
    }
}
