//! The training loop: the batch loss through the frozen model with the LoRA
//! residuals, gradients of the factors only (with accumulation and optional
//! norm clipping), AdamW updates on the learning-rate schedule, and the
//! validation loss.

use std::rc::Rc;
use std::time::Instant;

use mlx_rs::Array;
use mlx_rs::ops::{add, multiply};
use mlx_rs::optimizers::{AdamW, Optimizer};
use mlx_rs::transforms::value_and_grad_with_argnums;
use serde::Serialize;

use super::data::{Batch, Example, build_batch, make_batches};
use super::{LoraTrainable, SplitMix, TrainError, TrainSettings, TrainerState, mix};
use crate::engine::model::Transformer;
use crate::engine::model::weights::MlxResult;

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

/// The averaged gradients of one optimiser step, and what its micro-batches
/// held.
struct Accumulated {
    grads: Vec<Array>,
    /// Sum of the micro-batches' mean losses.
    loss_sum: f64,
    /// Counted (loss) tokens.
    trained: usize,
    /// Non-padding input tokens.
    input: usize,
}

/// A LoRA training run on one model (one thread).
pub struct Trainer<'m> {
    pub(super) model: &'m Transformer,
    pub settings: TrainSettings,
    pub lora: LoraTrainable,
    pub(super) optimizer: AdamW,
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
        let Accumulated {
            grads,
            loss_sum,
            trained,
            input,
        } = self.accumulate(step, accumulation)?;
        let (grads, grad_norm) = self.clip(grads)?;
        let learning_rate = self.settings.learning_rate_at(step);
        self.update(&grads, learning_rate)?;
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

    /// The gradients of optimiser step `step` over its `accumulation`
    /// micro-batches (averaged), each evaluated as it is made.
    fn accumulate(&self, step: usize, accumulation: usize) -> Result<Accumulated, TrainError> {
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
        Ok(Accumulated {
            grads,
            loss_sum,
            trained,
            input,
        })
    }

    /// The global norm of `grads`, and `grads` scaled down to
    /// `max_grad_norm` when that is set and exceeded.
    fn clip(&self, mut grads: Vec<Array>) -> Result<(Vec<Array>, f64), TrainError> {
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
        Ok((grads, grad_norm))
    }

    /// One AdamW update of the factors at `learning_rate`, evaluated with
    /// the optimiser's moments.
    fn update(&mut self, grads: &[Array], learning_rate: f64) -> Result<(), TrainError> {
        self.optimizer.lr = Array::from_f32(learning_rate as f32);
        let names: Vec<Rc<str>> = self.lora.names().into_iter().map(Rc::from).collect();
        for ((name, g), p) in names.iter().zip(grads).zip(self.lora.params.iter_mut()) {
            self.optimizer.update_single(name, g, p)?;
        }
        let mut live: Vec<&Array> = self.lora.params.iter().collect();
        for (m, v) in self.optimizer.state.values() {
            live.push(m);
            live.push(v);
        }
        mlx_rs::transforms::eval(live)?;
        Ok(())
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
}
