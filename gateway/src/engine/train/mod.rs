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
//!
//! This module holds what a run is configured with ([`TrainSettings`],
//! [`LoraSettings`]), its error type and the seeded generator every part
//! draws from; the parts sit in submodules whose items are re-exported here:
//!
//! * `data`: JSONL records into tokenized examples, and padded batches;
//! * `factors`: the trainable LoRA factors ([`LoraTrainable`]): init, the
//!   residual they add, mlx-lm's adapter files;
//! * `trainer`: the training loop ([`Trainer`]): loss, gradients, AdamW,
//!   validation;
//! * `checkpoint`: saving and resuming a run ([`TrainerState`]).

use serde::{Deserialize, Serialize};

use super::lora::Projection;

mod checkpoint;
mod data;
mod factors;
mod trainer;

pub use checkpoint::{TrainerState, read_checkpoint_state};
pub use data::{Example, Split, encode_record, load_split, read_jsonl};
pub use factors::{LoraTrainable, factor_name};
pub use trainer::{StepReport, Trainer};

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
}
