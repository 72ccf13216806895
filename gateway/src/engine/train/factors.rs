//! The trainable LoRA factors: A and B per adapted `(layer, projection)`,
//! their seeded initialisation, the residual `scale * (dropout(x) A) B` they
//! add to a projection's output, and mlx-lm's adapter files (save, load).

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::Array;
use mlx_rs::ops::{add, matmul, multiply};
use serde_json::json;

use super::{LoraSettings, TrainError, mix};
use crate::engine::lora::Projection;
use crate::engine::model::Transformer;
use crate::engine::model::weights::MlxResult;

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
    pub(super) fn residual(
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
