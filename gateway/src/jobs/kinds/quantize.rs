//! `quantize`: an HF/mlx model directory with f16/bf16/f32 safetensors ->
//! an MLX affine-quantized directory that mlx-lm style loaders read.
//!
//! Config: `input` (folder), `output_dir` (must not exist or be empty),
//! `bits` (4 or 8; default 4), `group_size` (32, 64 or 128; default 64),
//! `overrides` (optional): `{"<module>": {"bits": 8, "group_size": 32} | false}`,
//! where `<module>` is a module path (`model.embed_tokens`) or its last
//! dotted parts (`embed_tokens`, `mlp.down_proj`); `false` keeps it as is.
//!
//! Quantized: 2-D floating `*.weight` tensors whose input (last) dimension is
//! a multiple of the group size; norms, biases and anything else are kept.
//! Each quantized `<m>.weight` becomes `<m>.weight` (packed uint32),
//! `<m>.scales` and `<m>.biases` (MLX's layout). `config.json` gains
//! mlx-lm's `quantization` (and `quantization_config`) section, with an
//! entry per module whose settings differ from the defaults. Per tensor the
//! job reports the relative error ‖W − dequantize(quantize(W))‖ / ‖W‖ and
//! the largest error in units of its group's quantization step.
//!
//! Everything is written to `<output_dir>.partial-<job>` and renamed at the
//! end, so a failed or cancelled job leaves no half-written model behind.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use serde_json::{Map, Value, json};

use super::{ConfigError, Env, Fields, Outcome};
use crate::jobs::runner::{JobCtx, RunError};
use crate::jobs::types::JobEvent;

/// Bits and group size of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheme {
    pub bits: i32,
    pub group_size: i32,
}

#[derive(Debug)]
pub struct QuantizeSpec {
    input: PathBuf,
    output_dir: PathBuf,
    default: Scheme,
    /// (pattern, Some(scheme) or None to keep the module unquantized).
    overrides: Vec<(String, Option<Scheme>)>,
}

const BITS: [i32; 2] = [4, 8];
const GROUPS: [i32; 3] = [32, 64, 128];

fn scheme_field(
    v: &Value,
    key: &str,
    param: &str,
    allowed: &[i32],
    default: i32,
) -> Result<i32, ConfigError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .filter(|n| allowed.contains(n))
            .ok_or_else(|| ConfigError::new(param, format!("`{key}` must be one of {allowed:?}"))),
    }
}

/// One `overrides` entry: a module path and its scheme (`false`: keep it
/// unquantized); fields left out take the job's defaults.
fn parse_override(
    pattern: String,
    v: &Value,
    default: Scheme,
) -> Result<(String, Option<Scheme>), ConfigError> {
    let param = format!("config.overrides.{pattern}");
    if pattern.is_empty() || pattern.starts_with('.') || pattern.ends_with('.') {
        return Err(ConfigError::new(param, "override keys are module paths"));
    }
    let scheme = match v {
        Value::Bool(false) => None,
        Value::Object(o) => {
            if let Some(k) = o.keys().find(|k| *k != "bits" && *k != "group_size") {
                return Err(ConfigError::new(
                    param,
                    format!("unknown override field `{k}`"),
                ));
            }
            Some(Scheme {
                bits: scheme_field(v, "bits", &param, &BITS, default.bits)?,
                group_size: scheme_field(v, "group_size", &param, &GROUPS, default.group_size)?,
            })
        }
        _ => {
            return Err(ConfigError::new(
                param,
                "an override is {\"bits\", \"group_size\"} or false",
            ));
        }
    };
    Ok((pattern, scheme))
}

impl QuantizeSpec {
    pub fn parse(mut f: Fields, env: &Env<'_>) -> Result<QuantizeSpec, ConfigError> {
        let input = f.input_path("input", env.paths)?;
        if !input.join("config.json").is_file() {
            return Err(ConfigError::new(
                "config.input",
                "`input` must be a model folder with a config.json",
            ));
        }
        let output_dir = f.output_path("output_dir", env.paths)?;
        if output_dir.exists()
            && std::fs::read_dir(&output_dir).map_or(true, |mut d| d.next().is_some())
        {
            return Err(ConfigError::new(
                "config.output_dir",
                "`output_dir` already exists and is not an empty folder",
            ));
        }
        let bits = f.u64("bits", Some(4), 4..=8)? as i32;
        if !BITS.contains(&bits) {
            return Err(ConfigError::new("config.bits", "`bits` must be 4 or 8"));
        }
        let group_size = f.u64("group_size", Some(64), 32..=128)? as i32;
        if !GROUPS.contains(&group_size) {
            return Err(ConfigError::new(
                "config.group_size",
                "`group_size` must be 32, 64 or 128",
            ));
        }
        let default = Scheme { bits, group_size };
        let overrides = match f.take("overrides") {
            None => Vec::new(),
            Some(Value::Object(m)) => m
                .into_iter()
                .map(|(pattern, v)| parse_override(pattern, &v, default))
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(ConfigError::new(
                    "config.overrides",
                    "`overrides` must be an object of module -> {bits, group_size} | false",
                ));
            }
        };
        f.finish()?;
        Ok(QuantizeSpec {
            input,
            output_dir,
            default,
            overrides,
        })
    }

    /// The scheme for `module` (None: keep it unquantized). The longest
    /// matching pattern wins.
    fn scheme_for(&self, module: &str) -> Option<Scheme> {
        self.overrides
            .iter()
            .filter(|(p, _)| module == p || module.ends_with(&format!(".{p}")))
            .max_by_key(|(p, _)| p.len())
            .map_or(Some(self.default), |(_, s)| *s)
    }

    /// Reads the input's tensors, quantizes the matrices the scheme names,
    /// writes the result atomically and compares logits before and after;
    /// `stage` events along the way.
    pub fn run(self, ctx: &JobCtx) -> Result<Outcome, RunError> {
        let (mut config, files, size_before) = self.read_input()?;
        ctx.emit(JobEvent::stage(
            "load",
            Some(0.0),
            Some(format!(
                "{} safetensors file(s), {size_before} bytes",
                files.len()
            )),
        ));
        let tensors = load_tensors(ctx, &files)?;
        let total = tensors.len();
        let quantized = self.quantize_all(ctx, tensors)?;
        self.write_atomically(ctx, &quantized.tensors, &mut config, quantized.per_layer)?;
        let size_after =
            std::fs::metadata(self.output_dir.join("model.safetensors")).map_or(0, |m| m.len());
        let logits = self.evaluate(ctx);
        let reports = quantized.reports;
        let errors: Vec<f64> = reports
            .iter()
            .filter_map(|r| r["rel_error"].as_f64())
            .collect();
        let mean = if errors.is_empty() {
            0.0
        } else {
            errors.iter().sum::<f64>() / errors.len() as f64
        };
        let max = errors.iter().copied().fold(0.0, f64::max);
        let summary = json!({
            "bits": self.default.bits,
            "group_size": self.default.group_size,
            "tensors": total,
            "quantized": reports.len(),
            "size_before": size_before,
            "size_after": size_after,
            "compression": if size_after > 0 { size_before as f64 / size_after as f64 } else { 0.0 },
            "mean_rel_error": mean,
            "max_rel_error": max,
            "logit_error": logits,
            "per_tensor": reports,
        });
        ctx.emit(JobEvent::stage(
            "done",
            Some(1.0),
            Some(format!(
                "{} of {total} tensors quantized; {size_before} -> {size_after} bytes; mean relative error {mean:.4}",
                errors.len()
            )),
        ));
        Ok(Outcome {
            output_path: Some(self.output_dir.clone()),
            summary: Some(summary),
        })
    }

    /// The input's `config.json`, its `.safetensors` files (sorted) and
    /// their total size.
    fn read_input(&self) -> Result<(Value, Vec<PathBuf>, u64), RunError> {
        let config: Value = std::fs::read_to_string(self.input.join("config.json"))
            .map_err(|e| failed(format!("cannot read config.json: {e}")))
            .and_then(|t| {
                serde_json::from_str(&t)
                    .map_err(|e| failed(format!("config.json is not JSON: {e}")))
            })?;
        if !config.is_object() {
            return Err(failed("config.json is not a JSON object".into()));
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.input)
            .map_err(|e| failed(format!("cannot list {}: {e}", self.input.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(failed("the input folder has no .safetensors files".into()));
        }
        let size: u64 = files
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum();
        Ok((config, files, size))
    }

    /// The `quantize` stage: every matrix the scheme names, with its error
    /// (one event per tensor); the others pass through unchanged.
    fn quantize_all(
        &self,
        ctx: &JobCtx,
        tensors: BTreeMap<String, Array>,
    ) -> Result<Quantized, RunError> {
        let total = tensors.len();
        let mut q = Quantized {
            tensors: HashMap::with_capacity(total * 2),
            per_layer: Map::new(),
            reports: Vec::new(),
        };
        for (i, (name, w)) in tensors.into_iter().enumerate() {
            ctx.check()?;
            let module = name.strip_suffix(".weight");
            let floating = matches!(w.dtype(), Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32);
            let scheme = module.and_then(|m| self.scheme_for(m));
            let target = match (module, scheme) {
                (Some(m), Some(s))
                    if floating && w.ndim() == 2 && w.shape()[1] % s.group_size == 0 =>
                {
                    Some((m.to_owned(), s))
                }
                _ => None,
            };
            if let (Some(m), None) = (module, scheme)
                && floating
                && w.ndim() == 2
            {
                q.per_layer.insert(m.to_owned(), Value::Bool(false));
            }
            let Some((module, s)) = target else {
                q.tensors.insert(name, w);
                continue;
            };
            let progress = 0.9 * (i + 1) as f64 / total as f64;
            self.quantize_one(ctx, &mut q, &name, &module, &w, s, progress)?;
        }
        Ok(q)
    }

    /// Quantizes one matrix into `q`, reporting its error.
    #[allow(clippy::too_many_arguments)]
    fn quantize_one(
        &self,
        ctx: &JobCtx,
        q: &mut Quantized,
        name: &str,
        module: &str,
        w: &Array,
        s: Scheme,
        progress: f64,
    ) -> Result<(), RunError> {
        let (codes, scales, biases) = mlx_rs::ops::quantize(w, s.group_size, s.bits)
            .map_err(|e| failed(format!("cannot quantize {name}: {e}")))?;
        let err = error_of(w, &codes, &scales, &biases, s)
            .map_err(|e| failed(format!("cannot measure {name}: {e}")))?;
        if s != self.default {
            q.per_layer.insert(
                module.to_owned(),
                json!({"group_size": s.group_size, "bits": s.bits}),
            );
        }
        let mut extra = Map::new();
        extra.insert("tensor".into(), Value::from(name));
        extra.insert("bits".into(), Value::from(s.bits));
        extra.insert("group_size".into(), Value::from(s.group_size));
        extra.insert("rel_error".into(), Value::from(err.relative));
        extra.insert("max_step_error".into(), Value::from(err.max_steps));
        ctx.emit(JobEvent::Stage {
            stage: "quantize".into(),
            progress: Some(progress),
            message: Some(format!(
                "{name}: {}-bit, relative error {:.4}",
                s.bits, err.relative
            )),
            extra,
        });
        q.reports.push(json!({
            "tensor": name, "bits": s.bits, "group_size": s.group_size,
            "rel_error": err.relative, "max_step_error": err.max_steps,
        }));
        q.tensors.insert(format!("{module}.weight"), codes);
        q.tensors.insert(format!("{module}.scales"), scales);
        q.tensors.insert(format!("{module}.biases"), biases);
        Ok(())
    }

    /// The `write` stage: into a partial folder, then moved into place (a
    /// failed or cancelled job leaves no half-written output).
    fn write_atomically(
        &self,
        ctx: &JobCtx,
        out: &HashMap<String, Array>,
        config: &mut Value,
        per_layer: Map<String, Value>,
    ) -> Result<(), RunError> {
        ctx.check()?;
        ctx.emit(JobEvent::stage(
            "write",
            Some(0.92),
            Some("writing model.safetensors".into()),
        ));
        let tmp = partial_dir(&self.output_dir, ctx.id());
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)
            .map_err(|e| failed(format!("cannot create {}: {e}", tmp.display())))?;
        let written = self.write(&tmp, out, config, per_layer);
        let written = written.and_then(|()| {
            ctx.check()?;
            if self.output_dir.exists() {
                // Checked empty at submit; an empty folder may be replaced.
                std::fs::remove_dir(&self.output_dir)
                    .map_err(|e| failed(format!("`output_dir` is no longer empty: {e}")))?;
            }
            std::fs::rename(&tmp, &self.output_dir)
                .map_err(|e| failed(format!("cannot move the result into place: {e}")))
        });
        if written.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        written
    }

    /// The `evaluate` stage: logits of the original and quantized models on
    /// a text sample; `null` (and a log line) where the engine cannot run
    /// the input's architecture, which still quantizes.
    fn evaluate(&self, ctx: &JobCtx) -> Value {
        ctx.emit(JobEvent::stage(
            "evaluate",
            Some(0.95),
            Some("comparing logits of the original and quantized models on a text sample".into()),
        ));
        match logit_error(&self.input, &self.output_dir) {
            Ok(figures) => figures,
            Err(reason) => {
                ctx.emit(JobEvent::log(format!("logit check skipped: {reason}")));
                json!(null)
            }
        }
    }

    fn write(
        &self,
        dir: &Path,
        tensors: &HashMap<String, Array>,
        config: &mut Value,
        per_layer: Map<String, Value>,
    ) -> Result<(), RunError> {
        let fail = |m: String| RunError::Failed(m);
        let metadata = HashMap::from([("format".to_owned(), "mlx".to_owned())]);
        Array::save_safetensors(tensors, &metadata, dir.join("model.safetensors"))
            .map_err(|e| fail(format!("cannot write model.safetensors: {e}")))?;
        let mut q = Map::new();
        q.insert("group_size".into(), Value::from(self.default.group_size));
        q.insert("bits".into(), Value::from(self.default.bits));
        q.extend(per_layer);
        if let Value::Object(c) = config {
            c.insert("quantization".into(), Value::Object(q.clone()));
            c.insert("quantization_config".into(), Value::Object(q));
        }
        let text = serde_json::to_string_pretty(config).unwrap_or_default();
        std::fs::write(dir.join("config.json"), text)
            .map_err(|e| fail(format!("cannot write config.json: {e}")))?;
        // Tokenizer and generation files travel along; weights do not.
        let entries = std::fs::read_dir(&self.input)
            .map_err(|e| fail(format!("cannot list {}: {e}", self.input.display())))?;
        for entry in entries.flatten() {
            let p = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let skip = name == "config.json"
                || name.ends_with(".safetensors")
                || name.ends_with(".safetensors.index.json")
                || !p.is_file();
            if !skip {
                std::fs::copy(&p, dir.join(&name))
                    .map_err(|e| fail(format!("cannot copy {name}: {e}")))?;
            }
        }
        Ok(())
    }
}

/// Text the logit check runs through both models.
const LOGIT_SAMPLE: &str = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and the Seine runs through it.";

/// Runs `LOGIT_SAMPLE` token by token through the original and the quantized
/// model and compares next-token logits at every position: mean and max
/// absolute difference, and how often both pick the same next token.
fn logit_error(original: &Path, quantized: &Path) -> Result<Value, String> {
    use crate::engine::LoadedModel;
    let a = LoadedModel::load(original).map_err(|e| e.to_string())?;
    let b = LoadedModel::load(quantized).map_err(|e| e.to_string())?;
    let tokens = a.codec.encode(LOGIT_SAMPLE)?;
    let tokens = &tokens[..tokens.len().min(32)];
    let (mut cache_a, mut cache_b) = (a.transformer.new_cache(), b.transformer.new_cache());
    let (mut sum, mut max, mut count, mut agree) = (0.0f64, 0.0f32, 0usize, 0usize);
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold((0, f32::MIN), |m, (i, &x)| if x > m.1 { (i, x) } else { m })
            .0
    };
    for token in tokens {
        let step = |model: &LoadedModel,
                    cache: &mut crate::engine::model::KvCache|
         -> Result<Vec<f32>, String> {
            let logits = model
                .transformer
                .forward(&[&[*token]], &mut [cache])
                .map_err(|e| e.to_string())?;
            logits.eval().map_err(|e| e.to_string())?;
            Ok(logits.as_slice::<f32>().to_vec())
        };
        let (x, y) = (step(&a, &mut cache_a)?, step(&b, &mut cache_b)?);
        for (p, q) in x.iter().zip(&y) {
            let d = (p - q).abs();
            sum += f64::from(d);
            max = max.max(d);
        }
        count += x.len();
        agree += usize::from(argmax(&x) == argmax(&y));
    }
    Ok(json!({
        "sample_tokens": tokens.len(),
        "mean_abs": if count > 0 { sum / count as f64 } else { 0.0 },
        "max_abs": max,
        "top1_agreement": if tokens.is_empty() { 0.0 } else { agree as f64 / tokens.len() as f64 },
    }))
}

fn failed(message: String) -> RunError {
    RunError::Failed(message)
}

/// Quantized tensors with the config's per-layer overrides and the
/// per-tensor reports.
struct Quantized {
    tensors: HashMap<String, Array>,
    per_layer: Map<String, Value>,
    reports: Vec<Value>,
}

/// The `load` stage's work: every tensor of `files` (refusing an input that
/// is already quantized).
fn load_tensors(ctx: &JobCtx, files: &[PathBuf]) -> Result<BTreeMap<String, Array>, RunError> {
    let mut tensors: BTreeMap<String, Array> = BTreeMap::new();
    for p in files {
        ctx.check()?;
        let arrays = Array::load_safetensors(p)
            .map_err(|e| failed(format!("cannot load {}: {e}", p.display())))?;
        tensors.extend(arrays);
    }
    if tensors.keys().any(|k| k.ends_with(".scales")) {
        return Err(failed(
            "the input is already quantized (it has .scales tensors)".into(),
        ));
    }
    Ok(tensors)
}

fn partial_dir(output: &Path, job: &str) -> PathBuf {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    output.with_file_name(format!("{name}.partial-{job}"))
}

/// How far dequantize(quantize(W)) is from W.
pub struct QuantError {
    /// ‖W − Ŵ‖₂ / ‖W‖₂ (0 for an all-zero W).
    pub relative: f64,
    /// max |W − Ŵ| / scale of its group: ≤ 0.5 for round-to-nearest.
    pub max_steps: f64,
}

/// Compares `w` with its dequantized form, element by element in f32.
pub fn error_of(
    w: &Array,
    q: &Array,
    scales: &Array,
    biases: &Array,
    s: Scheme,
) -> Result<QuantError, String> {
    let deq = mlx_rs::ops::dequantize(q, scales, biases, s.group_size, s.bits)
        .and_then(|d| d.as_dtype(Dtype::Float32))
        .map_err(|e| e.to_string())?;
    let orig = w.as_dtype(Dtype::Float32).map_err(|e| e.to_string())?;
    let sc = scales.as_dtype(Dtype::Float32).map_err(|e| e.to_string())?;
    for a in [&deq, &orig, &sc] {
        a.eval().map_err(|e| e.to_string())?;
    }
    let (a, b, sc) = (
        orig.try_as_slice::<f32>().map_err(|e| e.to_string())?,
        deq.try_as_slice::<f32>().map_err(|e| e.to_string())?,
        sc.try_as_slice::<f32>().map_err(|e| e.to_string())?,
    );
    let group = s.group_size as usize;
    let (mut diff2, mut norm2, mut max_steps) = (0f64, 0f64, 0f64);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = f64::from(x - y);
        diff2 += d * d;
        norm2 += f64::from(*x) * f64::from(*x);
        let step = f64::from(sc.get(i / group).copied().unwrap_or(0.0)).abs();
        if step > 0.0 {
            max_steps = max_steps.max(d.abs() / step);
        }
    }
    let relative = if norm2 > 0.0 {
        (diff2 / norm2).sqrt()
    } else {
        0.0
    };
    Ok(QuantError {
        relative,
        max_steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(overrides: Vec<(&str, Option<Scheme>)>) -> QuantizeSpec {
        QuantizeSpec {
            input: PathBuf::new(),
            output_dir: PathBuf::new(),
            default: Scheme {
                bits: 4,
                group_size: 64,
            },
            overrides: overrides
                .into_iter()
                .map(|(p, s)| (p.to_owned(), s))
                .collect(),
        }
    }

    #[test]
    fn overrides_match_whole_dotted_suffixes_longest_first() {
        let eight = Scheme {
            bits: 8,
            group_size: 32,
        };
        let s = spec(vec![
            ("embed_tokens", Some(eight)),
            ("layers.0.mlp.up_proj", None),
            ("proj", None),
        ]);
        assert_eq!(s.scheme_for("model.embed_tokens"), Some(eight));
        assert_eq!(s.scheme_for("model.layers.0.mlp.up_proj"), None);
        assert_eq!(s.scheme_for("model.layers.1.mlp.up_proj"), Some(s.default));
        assert_eq!(s.scheme_for("model.my_embed_tokens"), Some(s.default));
    }
}
