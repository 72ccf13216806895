//! Saving and resuming a run: the adapter alone (mlx-lm's format), or a
//! checkpoint (the adapter, the optimiser moments and
//! `trainer_state.json`) replaced atomically, and checks that a checkpoint
//! belongs to the run resuming it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlx_rs::Array;
use serde::{Deserialize, Serialize};

use super::{LoraTrainable, TrainError, TrainSettings, Trainer};

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

impl Trainer<'_> {
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
