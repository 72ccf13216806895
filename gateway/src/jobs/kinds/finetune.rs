//! `finetune`: LoRA SFT of a base model (GGUF or HF/mlx folder, quantized
//! bases stay quantized and frozen) on a dataset folder, with the training
//! core in `engine::train`.
//!
//! Config: `model` (path), `data` (folder with `train.jsonl` and optionally
//! `valid.jsonl`; records are chat `messages`, `prompt`/`completion` or
//! `text`), and optional settings: `output_dir` (the adapter folder to
//! write; default: `<first adapter store>/<name>`, see below), `name` (the
//! adapter's name, checked like adapter ids: its folder in the store and
//! the id `mount` uses; default: the job's id, e.g. `job-000000000042`, or
//! `output_dir`'s folder name), `mount` (false; true mounts the finished
//! adapter on the served model loaded from `model`, else the first served
//! one, or on `mount_model`), and the training settings:
//! `rank` (8), `scale` (20) or `alpha` (scale = alpha / rank), `dropout`
//! (0), `keys` (projections, default all seven: `q_proj`, `k_proj`,
//! `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`), `num_layers`
//! (16, the last blocks), `learning_rate` (1e-5), `warmup_steps` (0),
//! `min_lr_ratio` (0), `weight_decay` (0.01), `batch_size` (4),
//! `max_seq_len` (2048), `iterations` (1000), `grad_accumulation` (1),
//! `max_grad_norm` (0: no clipping), `seed` (0), `mask_prompt` (true),
//! `val_interval` (200), `val_batches` (25), `checkpoint_interval` (100),
//! `report_interval` (10), `resume` (true), `dequantize_base` (true: train
//! on a dense float copy of a quantized base, which MLX's CPU backend runs
//! ~10x faster; false keeps the quantized matmuls and their memory saving).
//!
//! Events: `stage` `load` / `train` / `save` (and `mount`), `metric`
//! `{kind: "train", step, loss, grad_norm, learning_rate, tokens_per_sec,
//! progress}` every `report_interval` steps and `{kind: "val", step, loss}`
//! at step 0, every `val_interval` steps and at the end, `log` lines, then
//! `done` with `output_dir` and a summary (adapter name, `mounted_on`,
//! losses, time, tokens).
//!
//! Output: without `output_dir` the adapter goes to the first `[adapters]
//! stores` entry (default `<data_dir>/adapters`), so `GET
//! /v1/adapters/available` lists it under its name and `POST /v1/adapters`
//! mounts it as is. A name already holding an adapter is refused at submit
//! (400, `config.name`), as is `mount` with an `output_dir` outside the
//! stores or a name already mounted.
//!
//! Auto-mount: with `mount: true`, after the adapter is written the job
//! mounts it (what `POST /v1/adapters` does) with a `stage` `mount` event
//! before and one after (`adapter`, `model`, `path`). If mounting fails
//! the job ends `failed`: the error says why and where the written adapter
//! is, to mount by hand (the adapter stays in the store).
//!
//! Checkpoints (`<adapter folder>/checkpoint/`: adapter, optimiser moments,
//! `trainer_state.json`) are written every `checkpoint_interval` steps and
//! when the job is cancelled (it stops after the step it is in). A job
//! submitted again with the same config and destination — after a cancel,
//! a failure or a gateway crash (zombie) — resumes from the checkpoint (for
//! an unnamed store adapter, give the first job's id as `name`). A folder
//! holding only a checkpoint is not listed as available. On success the
//! adapter is written as `adapters.safetensors` + `adapter_config.json`
//! (mlx-lm's format, recording the base model) and the checkpoint removed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::{AdapterMounts, ConfigError, Env, Fields, Outcome};
use crate::engine::LoadedModel;
use crate::engine::lora::{self, Projection};
use crate::engine::train::{self, LoraSettings, TrainSettings, Trainer};
use crate::jobs::runner::{JobCtx, RunError};
use crate::jobs::types::JobEvent;

/// Where the adapter goes.
#[derive(Debug)]
enum Output {
    /// `output_dir`, as given.
    Dir(PathBuf),
    /// `<store>/<name>`, or `<store>/<job id>` without a `name`.
    Store { store: PathBuf },
}

/// `mount: true`: what to mount the finished adapter as, and where.
struct Mount {
    host: Arc<dyn AdapterMounts>,
    /// The served model (`mount_model`); default: the one loaded from the
    /// trained `model`, else the first served.
    model: Option<String>,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount").field("model", &self.model).finish()
    }
}

#[derive(Debug)]
pub struct FinetuneSpec {
    model: PathBuf,
    data: PathBuf,
    output: Output,
    /// The adapter's name: its folder in the store and the id it is mounted
    /// as. Default: the job's id (store output) or the folder name.
    name: Option<String>,
    mount: Option<Mount>,
    settings: TrainSettings,
    val_interval: usize,
    checkpoint_interval: usize,
    report_interval: usize,
    resume: bool,
    dequantize_base: bool,
}

fn bad(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::new(format!("config.{field}"), message)
}

fn parse_keys(v: Option<Value>) -> Result<Vec<Projection>, ConfigError> {
    let Some(v) = v else {
        return Ok(Projection::ALL.to_vec());
    };
    let list = v.as_array().filter(|l| !l.is_empty()).ok_or_else(|| {
        bad(
            "keys",
            "`keys` must be a non-empty list of projection names",
        )
    })?;
    let mut keys = Vec::new();
    for item in list {
        let name = item.as_str().unwrap_or_default();
        let p = train::projection_from_name(name).ok_or_else(|| {
            bad(
                "keys",
                format!(
                    "unknown projection `{name}`; use q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj or down_proj"
                ),
            )
        })?;
        if !keys.contains(&p) {
            keys.push(p);
        }
    }
    keys.sort();
    Ok(keys)
}

/// An adapter folder to write (or resume in): new, empty, or holding a
/// checkpoint to resume; `field` names the config field it came from.
fn check_output_dir(dir: &Path, field: &str, resume: bool) -> Result<(), ConfigError> {
    if !dir.exists() {
        return Ok(());
    }
    let what = if field == "name" {
        format!("the adapter store's `{}`", dir.display())
    } else {
        "`output_dir`".to_owned()
    };
    if !dir.is_dir() {
        return Err(bad(field, format!("{what} exists and is not a folder")));
    }
    if dir.join("adapters.safetensors").exists() {
        return Err(bad(
            field,
            format!("{what} already holds an adapter; choose a new {field}"),
        ));
    }
    let has_checkpoint = dir.join("checkpoint/trainer_state.json").is_file();
    let empty = std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none());
    if has_checkpoint && !resume {
        return Err(bad(
            "resume",
            format!("{what} holds a checkpoint; resume from it or choose a new {field}"),
        ));
    }
    if !has_checkpoint && !empty {
        return Err(bad(
            field,
            format!("{what} already exists and is neither empty nor a checkpointed run"),
        ));
    }
    Ok(())
}

/// `model` (a .gguf file or a model folder) and `data` (a folder with
/// train.jsonl).
fn parse_inputs(f: &mut Fields, env: &Env<'_>) -> Result<(PathBuf, PathBuf), ConfigError> {
    let model = f.input_path("model", env.paths)?;
    let is_gguf = model.is_file() && model.extension().is_some_and(|e| e == "gguf");
    if !is_gguf && !model.join("config.json").is_file() {
        return Err(bad(
            "model",
            "`model` must be a .gguf file or a model folder with config.json",
        ));
    }
    let data = f.input_path("data", env.paths)?;
    if !data.join("train.jsonl").is_file() {
        return Err(bad("data", "`data` must be a folder with train.jsonl"));
    }
    Ok((model, data))
}

/// Where the adapter goes (`output_dir`, or the first adapter store) and
/// whether a checkpoint there is resumed (`resume`).
fn parse_output(
    f: &mut Fields,
    env: &Env<'_>,
    name: Option<&str>,
) -> Result<(Output, bool), ConfigError> {
    let output_dir = f.opt_output_path("output_dir", env.paths)?;
    let resume = f.bool("resume", true)?;
    let output = match output_dir {
        Some(dir) => {
            check_output_dir(&dir, "output_dir", resume)?;
            Output::Dir(dir)
        }
        None => {
            let store = env.adapter_stores.first().ok_or_else(|| {
                bad(
                    "output_dir",
                    "no adapter store is configured ([adapters] stores); give `output_dir`",
                )
            })?;
            if let Some(n) = name {
                check_output_dir(&store.join(n), "name", resume)?;
            }
            Output::Store {
                store: store.clone(),
            }
        }
    };
    Ok((output, resume))
}

/// `mount` and `mount_model`: whether (and on which served model) the
/// finished adapter is mounted; it must land in an adapter store under an
/// id not mounted yet.
fn parse_mount(
    f: &mut Fields,
    env: &Env<'_>,
    output: &Output,
    name: Option<&str>,
) -> Result<Option<Mount>, ConfigError> {
    let mount = f.bool("mount", false)?;
    let model = f.opt_string("mount_model")?;
    match (mount, model) {
        (false, Some(_)) => Err(bad("mount_model", "`mount_model` needs `\"mount\": true`")),
        (false, None) => Ok(None),
        (true, model) => {
            let host = env
                .adapters
                .ok_or_else(|| bad("mount", "this gateway has no served models to mount on"))?;
            // The id it will be mounted as, where known now (a job's own id
            // is known once it is recorded, and is new).
            let id = match (output, name) {
                (_, Some(n)) => Some(n.to_owned()),
                (Output::Dir(dir), None) => {
                    let n = dir
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    lora::validate_id(&n).map_err(|e| {
                        bad(
                            "name",
                            format!("{e}; give `name` to mount `output_dir` under"),
                        )
                    })?;
                    Some(n)
                }
                (Output::Store { .. }, None) => None,
            };
            if let Output::Dir(dir) = output
                && !env
                    .adapter_stores
                    .iter()
                    .any(|s| dir.starts_with(s) && dir != s)
            {
                return Err(bad(
                    "mount",
                    "only adapters inside an adapter store ([adapters] stores) are mounted; leave out `output_dir` or put it in a store",
                ));
            }
            if let Some(id) = &id
                && host.is_mounted(id)
            {
                return Err(bad(
                    "name",
                    format!(
                        "an adapter `{id}` is already mounted; unmount it (DELETE /v1/adapters/{id}) or choose another `name`"
                    ),
                ));
            }
            Ok(Some(Mount {
                host: Arc::clone(host),
                model,
            }))
        }
    }
}

/// The adapter's shape: `rank`, `scale` (or `alpha`), `dropout`, `keys`,
/// `num_layers`.
fn parse_lora(f: &mut Fields) -> Result<LoraSettings, ConfigError> {
    let rank = f.u64("rank", Some(8), 1..=512)? as usize;
    let scale = match (f.take("scale"), f.take("alpha")) {
        (Some(_), Some(_)) => {
            return Err(bad("alpha", "give `scale` or `alpha`, not both"));
        }
        (Some(v), None) => v
            .as_f64()
            .filter(|s| *s > 0.0 && *s <= 1e4)
            .ok_or_else(|| bad("scale", "`scale` must be a number in (0, 10000]"))?,
        (None, Some(v)) => {
            v.as_f64()
                .filter(|a| *a > 0.0 && *a <= 1e6)
                .ok_or_else(|| bad("alpha", "`alpha` must be a positive number"))?
                / rank as f64
        }
        (None, None) => 20.0,
    };
    let dropout = f.f64("dropout", 0.0, 0.0..=0.9)?;
    let keys = parse_keys(f.take("keys"))?;
    let num_layers = f.u64("num_layers", Some(16), 1..=1024)? as usize;
    Ok(LoraSettings {
        rank,
        scale: scale as f32,
        dropout: dropout as f32,
        keys,
        num_layers,
    })
}

/// How often the job reports, validates and checkpoints, in steps.
struct Intervals {
    val: usize,
    checkpoint: usize,
    report: usize,
}

/// The optimiser, data and schedule settings, and the intervals.
fn parse_training(
    f: &mut Fields,
    lora: LoraSettings,
) -> Result<(TrainSettings, Intervals), ConfigError> {
    let learning_rate = f.f64("learning_rate", 1e-5, 1e-9..=1.0)?;
    let warmup_steps = f.u64("warmup_steps", Some(0), 0..=1_000_000)? as usize;
    let min_lr_ratio = f.f64("min_lr_ratio", 0.0, 0.0..=1.0)?;
    let weight_decay = f.f64("weight_decay", 0.01, 0.0..=1.0)?;
    let batch_size = f.u64("batch_size", Some(4), 1..=1024)? as usize;
    let max_seq_len = f.u64("max_seq_len", Some(2048), 2..=131_072)? as usize;
    let iterations = f.u64("iterations", Some(1000), 1..=10_000_000)? as usize;
    let grad_accumulation = f.u64("grad_accumulation", Some(1), 1..=1024)? as usize;
    let max_grad_norm = f.f64("max_grad_norm", 0.0, 0.0..=1e6)?;
    let seed = f.u64("seed", Some(0), 0..=u64::MAX)?;
    let mask_prompt = f.bool("mask_prompt", true)?;
    let val = f.u64("val_interval", Some(200), 0..=10_000_000)? as usize;
    let val_batches = f.u64("val_batches", Some(25), 0..=1_000_000)? as usize;
    let checkpoint = f.u64("checkpoint_interval", Some(100), 0..=10_000_000)? as usize;
    let report = f.u64("report_interval", Some(10), 1..=10_000_000)? as usize;
    let settings = TrainSettings {
        lora,
        learning_rate,
        warmup_steps,
        min_lr_ratio,
        weight_decay,
        batch_size,
        max_seq_len,
        iterations,
        grad_accumulation,
        max_grad_norm,
        seed,
        mask_prompt,
        val_batches,
    };
    Ok((
        settings,
        Intervals {
            val,
            checkpoint,
            report,
        },
    ))
}

impl FinetuneSpec {
    /// Reads and checks a finetune job's config. Fields are read in a fixed
    /// order (inputs, output, mount, LoRA, training), which decides the first
    /// error reported; any field left over is refused.
    pub fn parse(mut f: Fields, env: &Env<'_>) -> Result<FinetuneSpec, ConfigError> {
        let (model, data) = parse_inputs(&mut f, env)?;
        let name = f.opt_string("name")?;
        if let Some(n) = &name {
            lora::validate_id(n).map_err(|e| bad("name", e.to_string()))?;
        }
        let (output, resume) = parse_output(&mut f, env, name.as_deref())?;
        let mount = parse_mount(&mut f, env, &output, name.as_deref())?;
        let lora = parse_lora(&mut f)?;
        let (settings, intervals) = parse_training(&mut f, lora)?;
        let dequantize_base = f.bool("dequantize_base", true)?;
        if settings.warmup_steps > settings.iterations {
            return Err(bad("warmup_steps", "`warmup_steps` exceeds `iterations`"));
        }
        f.finish()?;
        Ok(FinetuneSpec {
            model,
            data,
            output,
            name,
            mount,
            settings,
            val_interval: intervals.val,
            checkpoint_interval: intervals.checkpoint,
            report_interval: intervals.report,
            resume,
            dequantize_base,
        })
    }

    /// Fingerprint of the inputs: the model's name and size, the data files.
    fn run_fingerprint(&self, model_id: &str) -> String {
        let mut h = Sha256::new();
        h.update(model_id.as_bytes());
        h.update(
            std::fs::metadata(&self.model)
                .map_or(0, |m| m.len())
                .to_le_bytes(),
        );
        for name in ["train.jsonl", "valid.jsonl"] {
            h.update(name.as_bytes());
            h.update(std::fs::read(self.data.join(name)).unwrap_or_default());
        }
        h.finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The adapter folder and its name (the job's id for unnamed store
    /// output).
    fn destination(&self, job_id: &str) -> (PathBuf, String) {
        match &self.output {
            Output::Dir(dir) => {
                let name = self.name.clone().unwrap_or_else(|| {
                    dir.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                });
                (dir.clone(), name)
            }
            Output::Store { store } => {
                let name = self.name.clone().unwrap_or_else(|| job_id.to_owned());
                (store.join(&name), name)
            }
        }
    }

    /// Loads the model and data, trains (resuming a checkpoint when asked),
    /// writes the adapter and mounts it when asked; `stage`, `metric` and
    /// `log` events along the way.
    pub fn run(self, ctx: &JobCtx) -> Result<Outcome, RunError> {
        let started = Instant::now();
        let (out, adapter_name) = self.destination(ctx.id());
        // Checked at submit; a job queued behind another of the same name
        // finds its adapter here.
        if out.join("adapters.safetensors").exists() {
            return Err(RunError::Failed(format!(
                "{} already holds an adapter; choose a new name or output_dir",
                out.display()
            )));
        }
        let model = self.load_model(ctx)?;
        // Training's matmuls are large and dense: BLAS on every core while it
        // runs (engines on native kernels keep it to one).
        let _blas = crate::mlx::kernels::BlasThreads::all_cores();
        let dense = self.dense_base(ctx, &model)?;
        let base_model = dense.as_ref().unwrap_or(&model.transformer);
        let (train_examples, valid_examples) = self.load_data(ctx, &model)?;
        let s = &self.settings;
        let mut trainer = Trainer::new(
            base_model,
            s.clone(),
            train_examples,
            valid_examples,
            self.run_fingerprint(&model.id),
        )
        .map_err(failed)?;
        let checkpoint = out.join("checkpoint");
        let mut resumed_from = None;
        if self.resume && checkpoint.join("trainer_state.json").is_file() {
            trainer.resume(&checkpoint).map_err(failed)?;
            resumed_from = Some(trainer.state.step);
            ctx.log(format!(
                "resumed from the checkpoint at step {}",
                trainer.state.step
            ));
        }
        let (n_train, n_valid) = trainer.sizes();
        ctx.emit(JobEvent::stage(
            "load",
            Some(0.0),
            Some(format!(
                "{}: {} layers; {n_train} training and {n_valid} validation examples; {} trainable parameters (rank {}, {} projections x {} layers)",
                model.id,
                model.transformer.config.layers,
                trainer.lora.parameter_count(),
                s.lora.rank,
                s.lora.keys.len(),
                s.lora.num_layers
            )),
        ));

        let base = model.id.clone();
        let losses = self.train(ctx, &mut trainer, &checkpoint, &base)?;

        let mounted_on = self.save(ctx, &trainer, &out, &adapter_name, &base)?;
        let st = &trainer.state;
        let summary = json!({
            "adapter": adapter_name,
            "mounted_on": mounted_on,
            "base_model": base,
            "steps": st.step,
            "resumed_from": resumed_from,
            "final_train_loss": losses.last_train,
            "initial_val_loss": losses.first_val,
            "final_val_loss": losses.last_val,
            "val_losses": st.val_losses,
            "train_seconds": st.train_seconds,
            "wall_seconds": started.elapsed().as_secs_f64(),
            "trained_tokens": st.trained_tokens,
            "input_tokens": st.input_tokens,
            "tokens_per_sec": st.trained_tokens as f64 / st.train_seconds.max(1e-9),
            "trainable_parameters": trainer.lora.parameter_count(),
            "train_examples": n_train,
            "valid_examples": n_valid,
        });
        Ok(Outcome {
            output_path: Some(out),
            summary: Some(summary),
        })
    }

    /// The `save` stage: the adapter written (its checkpoint removed) and,
    /// when asked, mounted; returns the model it was mounted on.
    fn save(
        &self,
        ctx: &JobCtx,
        trainer: &Trainer<'_>,
        out: &Path,
        adapter_name: &str,
        base: &str,
    ) -> Result<Option<String>, RunError> {
        ctx.emit(JobEvent::stage(
            "save",
            Some(1.0),
            Some(format!("writing the adapter to {}", out.display())),
        ));
        write_adapter(out, trainer, base)?;
        let _ = std::fs::remove_dir_all(out.join("checkpoint"));
        match &self.mount {
            Some(m) => Ok(Some(mount_adapter(ctx, m, adapter_name, out, &self.model)?)),
            None => Ok(None),
        }
    }

    /// The `load` stage: the base model, checked against `num_layers`.
    fn load_model(&self, ctx: &JobCtx) -> Result<LoadedModel, RunError> {
        ctx.emit(JobEvent::stage(
            "load",
            Some(0.0),
            Some(format!("loading {}", self.model.display())),
        ));
        let model = LoadedModel::load(&self.model)
            .map_err(|e| RunError::Failed(format!("cannot load the model: {e}")))?;
        let layers = model.transformer.config.layers;
        if self.settings.lora.num_layers > layers {
            return Err(RunError::Failed(format!(
                "num_layers {} exceeds the model's {layers} layers",
                self.settings.lora.num_layers
            )));
        }
        Ok(model)
    }

    /// A dense copy of a quantized base when asked (`dequantize_base`): the
    /// base stays frozen either way, and dense matrices make MLX's CPU
    /// backend much faster (BLAS). The base actually trained on is
    /// evaluated here.
    fn dense_base(
        &self,
        ctx: &JobCtx,
        model: &LoadedModel,
    ) -> Result<Option<crate::engine::model::Transformer>, RunError> {
        let dense = if self.dequantize_base {
            Some(
                model
                    .transformer
                    .dequantized()
                    .map_err(|e| RunError::Failed(format!("cannot dequantize the base: {e}")))?,
            )
        } else {
            None
        };
        let base = dense.as_ref().unwrap_or(&model.transformer);
        mlx_rs::transforms::eval(base.parameters())
            .map_err(|e| RunError::Failed(format!("cannot load the model: {e}")))?;
        ctx.check()?;
        Ok(dense)
    }

    /// The training and (if present) validation examples, tokenized; logs
    /// how many were cut to `max_seq_len`.
    fn load_data(
        &self,
        ctx: &JobCtx,
        model: &LoadedModel,
    ) -> Result<(Vec<train::Example>, Vec<train::Example>), RunError> {
        let s = &self.settings;
        let train_split =
            train::load_split(&self.data.join("train.jsonl"), &model.codec, s).map_err(failed)?;
        let valid_path = self.data.join("valid.jsonl");
        let valid_split = if valid_path.is_file() {
            Some(train::load_split(&valid_path, &model.codec, s).map_err(failed)?)
        } else {
            None
        };
        let truncated = train_split.truncated + valid_split.as_ref().map_or(0, |v| v.truncated);
        if truncated > 0 {
            ctx.log(format!(
                "{truncated} example(s) longer than max_seq_len {} were cut",
                s.max_seq_len
            ));
        }
        let valid = valid_split.map(|v| v.examples).unwrap_or_default();
        Ok((train_split.examples, valid))
    }

    /// The `train` stage: steps to `iterations`, with a `train` metric every
    /// `report_interval` steps, a `val` metric every `val_interval` (and at
    /// both ends), a checkpoint every `checkpoint_interval` and on cancel.
    fn train(
        &self,
        ctx: &JobCtx,
        trainer: &mut Trainer<'_>,
        checkpoint: &Path,
        base: &str,
    ) -> Result<Losses, RunError> {
        let iterations = self.settings.iterations;
        let mut losses = Losses {
            first_val: trainer.state.val_losses.first().map(|v| v.1),
            last_val: trainer.state.val_losses.last().map(|v| v.1),
            last_train: None,
        };
        if trainer.state.step == 0
            && let Some(loss) = trainer.validate().map_err(failed)?
        {
            trainer.state.val_losses.push((0, loss));
            losses.validated(loss);
            ctx.emit(val_metric(0, iterations, loss));
        }
        ctx.emit(JobEvent::stage(
            "train",
            Some(progress(trainer.state.step, iterations)),
            Some(format!(
                "training from step {} to {iterations}",
                trainer.state.step
            )),
        ));
        let save_checkpoint = |trainer: &Trainer<'_>| -> Result<(), RunError> {
            trainer.save_checkpoint(checkpoint, base).map_err(failed)?;
            ctx.log(format!("checkpoint saved at step {}", trainer.state.step));
            Ok(())
        };
        let mut last_checkpoint = trainer.state.step;
        let mut window = Window::default();
        while trainer.state.step < iterations {
            if ctx.is_cancelled() {
                if trainer.state.step > last_checkpoint {
                    save_checkpoint(trainer)?;
                }
                return Err(RunError::Cancelled);
            }
            let r = trainer.step().map_err(failed)?;
            if !r.loss.is_finite() {
                return Err(RunError::Failed(format!(
                    "the loss is {} at step {}; lower the learning rate",
                    r.loss, r.step
                )));
            }
            window.add(&r);
            losses.last_train = Some(r.loss);
            if r.step % self.report_interval == 0 || r.step == iterations {
                ctx.emit(window.take_metric(&r, trainer.state.trained_tokens, iterations));
            }
            let validate_now =
                (self.val_interval > 0 && r.step % self.val_interval == 0) || r.step == iterations;
            if validate_now && let Some(loss) = trainer.validate().map_err(failed)? {
                trainer.state.val_losses.push((r.step, loss));
                losses.validated(loss);
                ctx.emit(val_metric(r.step, iterations, loss));
            }
            if self.checkpoint_interval > 0
                && r.step % self.checkpoint_interval == 0
                && r.step < iterations
            {
                save_checkpoint(trainer)?;
                last_checkpoint = r.step;
            }
        }
        Ok(losses)
    }
}

fn failed(e: train::TrainError) -> RunError {
    RunError::Failed(e.to_string())
}

fn progress(step: usize, iterations: usize) -> f64 {
    step as f64 / iterations as f64
}

/// The losses the job's summary reports.
struct Losses {
    first_val: Option<f64>,
    last_val: Option<f64>,
    last_train: Option<f64>,
}

impl Losses {
    fn validated(&mut self, loss: f64) {
        self.first_val.get_or_insert(loss);
        self.last_val = Some(loss);
    }
}

/// The steps since the last `train` metric, which reports their mean.
#[derive(Default)]
struct Window {
    loss: f64,
    steps: usize,
    tokens: usize,
    secs: f64,
}

impl Window {
    fn add(&mut self, r: &train::StepReport) {
        self.loss += r.loss;
        self.steps += 1;
        self.tokens += r.trained_tokens;
        self.secs += r.seconds;
    }

    /// The `train` metric at step `r` for the window, which starts over.
    fn take_metric(&mut self, r: &train::StepReport, trained: u64, iterations: usize) -> JobEvent {
        let w = std::mem::take(self);
        let tokens_per_sec = w.tokens as f64 / w.secs.max(1e-9);
        let loss = w.loss / w.steps as f64;
        let mut extra = Map::new();
        extra.insert("grad_norm".into(), json!(r.grad_norm));
        extra.insert("learning_rate".into(), json!(r.learning_rate));
        extra.insert("tokens_per_sec".into(), json!(tokens_per_sec));
        extra.insert("trained_tokens".into(), json!(trained));
        JobEvent::Metric {
            kind: "train".into(),
            step: r.step as u64,
            loss: Some(loss),
            progress: Some(progress(r.step, iterations)),
            message: Some(format!(
                "step {}/{iterations}: loss {loss:.4}, {tokens_per_sec:.0} tokens/s",
                r.step
            )),
            extra,
        }
    }
}

fn val_metric(step: usize, iterations: usize, loss: f64) -> JobEvent {
    JobEvent::Metric {
        kind: "val".into(),
        step: step as u64,
        loss: Some(loss),
        progress: Some(progress(step, iterations)),
        message: Some(format!(
            "step {step}/{iterations}: validation loss {loss:.4}"
        )),
        extra: Map::new(),
    }
}

/// Mounts the finished adapter on a served model (`mount: true`), with a
/// `stage` event before and after; returns the model's id. A failure fails
/// the job: the caller asked for a mounted adapter, and the error says where
/// the adapter is, to mount it by hand.
fn mount_adapter(
    ctx: &JobCtx,
    m: &Mount,
    id: &str,
    dir: &Path,
    base: &Path,
) -> Result<String, RunError> {
    let stage = |message: String, model: Option<&str>| {
        let mut event = JobEvent::stage("mount", Some(1.0), Some(message));
        if let JobEvent::Stage { extra, .. } = &mut event {
            extra.insert("adapter".into(), json!(id));
            extra.insert("path".into(), json!(dir));
            if let Some(model) = model {
                extra.insert("model".into(), json!(model));
            }
        }
        event
    };
    ctx.emit(stage(format!("mounting the adapter as `{id}`"), None));
    match m.host.mount(id, dir, m.model.as_deref(), base) {
        Ok(model) => {
            ctx.emit(stage(
                format!("mounted as `{id}` on {model}; select it with \"adapter\": \"{id}\""),
                Some(&model),
            ));
            Ok(model)
        }
        Err(e) => Err(RunError::Failed(format!(
            "the adapter was written to {} but mounting it as `{id}` failed: {e}; mount it with POST /v1/adapters",
            dir.display()
        ))),
    }
}

/// Writes the adapter next to (then over) temporary names, config last, so
/// a listing never sees a half-written adapter.
fn write_adapter(out: &Path, trainer: &Trainer<'_>, base: &str) -> Result<(), RunError> {
    let tmp = out.join(".partial");
    let _ = std::fs::remove_dir_all(&tmp);
    trainer
        .save_adapter(&tmp, base)
        .map_err(|e| RunError::Failed(e.to_string()))?;
    for name in ["adapters.safetensors", "adapter_config.json"] {
        std::fs::rename(tmp.join(name), out.join(name))
            .map_err(|e| RunError::Failed(format!("cannot move {name} into place: {e}")))?;
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}
