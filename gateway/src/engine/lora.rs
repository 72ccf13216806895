//! LoRA adapters mounted on a loaded base model (quantized or not), chosen
//! per request, stacked in order, never touching the base weights.
//!
//! Formats: mlx-lm (`adapters.safetensors` + `adapter_config.json` with
//! `lora_parameters.{rank,scale}`, tensors `…q_proj.lora_a` `[in, r]` and
//! `…lora_b` `[r, out]`) and PEFT (`adapter_model.safetensors`, `r` and
//! `lora_alpha` giving scale = alpha / r, tensors `…lora_A.weight` `[r, in]`
//! and `…lora_B.weight` `[out, r]`), with or without a `language_model.`
//! prefix. A mount checks every pair against the base linear it targets
//! before anything is kept (all or nothing), as mlx-bun's `lora.ts` did.
//!
//! The residual is mlx-lm's `LoRALinear`: `y + scale * ((x A) B)`, in the
//! activation dtype; the scale is folded into `B` at mount.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlx_rs::Array;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{addmm, concatenate, matmul, multiply};
use serde_json::Value;

use super::model::weights::MlxResult;

/// The seven projections of a decoder block an adapter may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Projection {
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// The module path inside a block, as Hugging Face names it.
    pub fn module(self) -> &'static str {
        match self {
            Projection::Q => "self_attn.q_proj",
            Projection::K => "self_attn.k_proj",
            Projection::V => "self_attn.v_proj",
            Projection::O => "self_attn.o_proj",
            Projection::Gate => "mlp.gate_proj",
            Projection::Up => "mlp.up_proj",
            Projection::Down => "mlp.down_proj",
        }
    }
}

/// Why an adapter cannot be mounted; every message names what is wrong.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum AdapterError {
    #[error("{0}: {1}")]
    Io(PathBuf, String),
    #[error("{0}")]
    Invalid(String),
}

/// What a mounted adapter is, for listings and policies.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AdapterInfo {
    pub id: String,
    pub path: PathBuf,
    /// `mlx-lm` or `peft`.
    pub format: &'static str,
    pub rank: usize,
    pub scale: f32,
    /// The base model its config records, if any.
    pub base_model: Option<String>,
    /// Linear layers it changes.
    pub modules: usize,
    /// Tensors for modules outside the seven projections (ignored).
    pub skipped_tensors: usize,
    pub size_bytes: u64,
}

/// One LoRA pair on one projection: `x @ a @ b_scaled`.
struct Pair {
    a: Array,
    b_scaled: Array,
    /// The same factors as plain f32 rows, for the native decode step; built
    /// at mount when activations are f32 (always on CPU).
    native: Option<NativePair>,
}

/// A pair's factors as the native decode step reads them: `a` transposed
/// (`[r, in]`, so each of the r inner products reads one contiguous row)
/// and `b_scaled` (`[r, out]`, so each update is one contiguous row).
struct NativePair {
    rank: usize,
    a_t: Vec<f32>,
    b_scaled: Vec<f32>,
}

impl NativePair {
    fn new(a: &Array, b_scaled: &Array) -> MlxResult<NativePair> {
        let a_t = a.t().contiguous()?;
        let b_scaled = b_scaled.contiguous()?;
        mlx_rs::transforms::eval([&a_t, &b_scaled])?;
        Ok(NativePair {
            rank: b_scaled.shape()[0] as usize,
            a_t: a_t.as_slice::<f32>().to_vec(),
            b_scaled: b_scaled.as_slice::<f32>().to_vec(),
        })
    }
}

/// A mounted adapter's arrays (on the engine thread) and its facts.
pub struct Adapter {
    pub info: AdapterInfo,
    pairs: HashMap<(usize, Projection), Pair>,
}

/// The adapters a sequence runs with, in stacking order. `Rc`: adapters
/// (MLX arrays) never leave the engine thread that mounted them.
pub type AdapterStack = Vec<Rc<Adapter>>;

/// The `(in, out)` features of every projection of the base model, keyed by
/// `(layer, projection)`: what a mount validates against.
pub type Targets = BTreeMap<(usize, Projection), (usize, usize)>;

/// Most adapters one request may stack: the same cap an adapter-selector
/// policy's choice has. Each stacked adapter adds work to every projection
/// of every step, so a client must not be able to ask for thousands.
pub const MAX_STACK: usize = 64;

/// Splits a selection spec: `a+b` or `a,b` stack in order; `none` or empty
/// means no adapter. At most [`MAX_STACK`] ids, each a valid id and named
/// once; the error says which rule the spec broke.
pub fn parse_spec(spec: &str) -> Result<Vec<String>, String> {
    let spec = spec.trim();
    if spec.is_empty() || spec.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    let separator = if spec.contains('+') { '+' } else { ',' };
    let mut ids: Vec<String> = Vec::new();
    // `take` stops the split early: a huge spec costs no more than a legal one.
    for id in spec
        .split(separator)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .take(MAX_STACK + 1)
    {
        if ids.len() == MAX_STACK {
            return Err(format!(
                "too many adapters: at most {MAX_STACK} may be stacked in one request"
            ));
        }
        validate_id(id).map_err(|e| e.to_string())?;
        if ids.iter().any(|seen| seen == id) {
            return Err(format!(
                "adapter `{id}` is named twice; stack each adapter once"
            ));
        }
        ids.push(id.to_owned());
    }
    Ok(ids)
}

/// An adapter id: 1-64 of `A-Z a-z 0-9 . _ -` (so never `+` or `,`).
pub fn validate_id(id: &str) -> Result<(), AdapterError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok && !id.eq_ignore_ascii_case("none") {
        Ok(())
    } else {
        Err(AdapterError::Invalid(format!(
            "invalid adapter id `{id}`: use 1 to 64 letters, digits, '.', '_' or '-' ('+' and ',' stack adapters in requests; `none` is reserved)"
        )))
    }
}

/// An adapter directory's config, read without loading its tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    pub format: &'static str,
    pub weights: PathBuf,
    pub rank: usize,
    pub scale: f32,
    pub base_model: Option<String>,
}

/// Reads `adapter_config.json` and finds the weights file of `dir`.
pub fn read_config(dir: &Path) -> Result<AdapterConfig, AdapterError> {
    let config_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| {
        AdapterError::Io(
            config_path.clone(),
            format!("{e} (an adapter directory needs adapter_config.json)"),
        )
    })?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| AdapterError::Io(config_path.clone(), format!("not JSON: {e}")))?;
    let invalid =
        |what: String| AdapterError::Invalid(format!("{}: {what}", config_path.display()));
    if let Some(kind) = json.get("fine_tune_type").and_then(Value::as_str)
        && kind != "lora"
    {
        return Err(invalid(format!(
            "fine_tune_type `{kind}` is not supported (only lora)"
        )));
    }
    let number = |v: Option<&Value>| v.and_then(Value::as_f64);
    let (format, weights_name, rank, scale) = if let Some(params) = json.get("lora_parameters") {
        let rank = number(params.get("rank"))
            .ok_or_else(|| invalid("lora_parameters.rank is missing".into()))?;
        let scale = number(params.get("scale")).unwrap_or(20.0);
        ("mlx-lm", "adapters.safetensors", rank, scale)
    } else if let Some(r) = number(json.get("r")) {
        let alpha = number(json.get("lora_alpha")).unwrap_or(r);
        if r <= 0.0 {
            return Err(invalid(format!("r = {r} must be positive")));
        }
        ("peft", "adapter_model.safetensors", r, alpha / r)
    } else {
        return Err(invalid(
            "neither `lora_parameters` (mlx-lm) nor `r` (PEFT) is present".into(),
        ));
    };
    let weights = dir.join(weights_name);
    if !weights.is_file() {
        return Err(AdapterError::Io(
            weights,
            "missing (the weights of this adapter format)".into(),
        ));
    }
    let base_model = ["base_model_name_or_path", "model", "source_model"]
        .iter()
        .find_map(|key| json.get(*key).and_then(Value::as_str))
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    Ok(AdapterConfig {
        format,
        weights,
        rank: rank as usize,
        scale: scale as f32,
        base_model,
    })
}

/// Whether an adapter's recorded base model names the served one: the last
/// path components, lowercased, one containing the other (recorded values
/// are repo ids, local snapshot paths or converted folders).
pub fn same_base_model(recorded: &str, served: &str) -> bool {
    let last = |s: &str| {
        let s = s.trim_end_matches('/');
        let s = s.rsplit('/').next().unwrap_or(s).to_lowercase();
        s.strip_suffix(".gguf").map(str::to_owned).unwrap_or(s)
    };
    let (recorded, served) = (last(recorded), last(served));
    !recorded.is_empty()
        && !served.is_empty()
        && (recorded.contains(&served) || served.contains(&recorded))
}

/// Whether the base model an adapter records fits the served one. A record
/// naming a local model folder (mlx-lm writes the path it trained on, often
/// a converted or dequantized copy) is compared by its `config.json`: same
/// hidden size and layer count. Anything else is compared by name.
fn recorded_base_fits(recorded: &str, served: &str, targets: &Targets) -> bool {
    let config = Path::new(recorded).join("config.json");
    let Some(json) = std::fs::read_to_string(&config)
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
    else {
        return same_base_model(recorded, served);
    };
    let hidden = targets.get(&(0, Projection::Q)).map(|&(input, _)| input);
    let layers = targets.keys().map(|&(layer, _)| layer + 1).max();
    let number = |key: &str| json.get(key).and_then(Value::as_u64).map(|n| n as usize);
    number("hidden_size") == hidden && number("num_hidden_layers") == layers
}

/// Maps a tensor name to `(layer, projection, is_a)`; `None` for tensors
/// that are not LoRA factors of the seven projections.
fn parse_tensor_name(name: &str) -> Option<(usize, Projection, bool)> {
    let name = name.strip_suffix(".weight").unwrap_or(name);
    let (module, factor) = name.rsplit_once('.')?;
    let is_a = match factor {
        "lora_a" | "lora_A" => true,
        "lora_b" | "lora_B" => false,
        _ => return None,
    };
    let mut rest = module.strip_prefix("base_model.model.").unwrap_or(module);
    rest = rest.strip_prefix("language_model.").unwrap_or(rest);
    let rest = rest.strip_prefix("model.layers.")?;
    let (layer, projection) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let projection = Projection::ALL
        .into_iter()
        .find(|p| p.module() == projection)?;
    Some((layer, projection, is_a))
}

/// Both factors of each `(layer, projection)` an adapter names, as found.
type Halves = BTreeMap<(usize, Projection), (Option<Array>, Option<Array>)>;

/// The adapter file's LoRA factors by the projection they adapt, and how
/// many of its tensors are not LoRA factors. A factor of a projection the
/// base model lacks, or no factor of one it has, is an error.
fn factor_halves(
    id: &str,
    tensors: HashMap<String, Array>,
    targets: &Targets,
) -> Result<(Halves, usize), AdapterError> {
    let mut halves = Halves::new();
    let mut skipped = 0;
    for (name, array) in tensors {
        match parse_tensor_name(&name) {
            Some((layer, projection, is_a)) if targets.contains_key(&(layer, projection)) => {
                let slot = halves.entry((layer, projection)).or_default();
                if is_a {
                    slot.0 = Some(array)
                } else {
                    slot.1 = Some(array)
                }
            }
            Some((layer, projection, _)) => {
                return Err(AdapterError::Invalid(format!(
                    "adapter `{id}` targets model.layers.{layer}.{}, which the base model does not have",
                    projection.module()
                )));
            }
            None => skipped += 1,
        }
    }
    if halves.is_empty() {
        return Err(AdapterError::Invalid(format!(
            "adapter `{id}` matches none of the base model's projections (q/k/v/o/gate/up/down_proj): was it trained for another model?"
        )));
    }
    Ok((halves, skipped))
}

/// A factor pair in mlx-lm's orientation (`a` `[in, r]`, `b` `[r, out]`;
/// PEFT stores both transposed), checked against the base linear's
/// `(in, out)`; with its rank.
fn oriented_pair(
    module: &str,
    a: Array,
    b: Array,
    peft: bool,
    (input, output): (usize, usize),
) -> Result<(Array, Array, usize), AdapterError> {
    let (a, b) = if peft { (a.t(), b.t()) } else { (a, b) };
    let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
    let fits = a_shape.len() == 2
        && b_shape.len() == 2
        && a_shape[0] as usize == input
        && a_shape[1] == b_shape[0]
        && b_shape[1] as usize == output;
    if !fits {
        return Err(AdapterError::Invalid(format!(
            "{module}: lora_a {a_shape:?} and lora_b {b_shape:?} do not fit the base linear (in {input}, out {output}); was this adapter trained for another base model?"
        )));
    }
    let rank = a_shape[1] as usize;
    Ok((a, b, rank))
}

/// Evaluates every pair, and gives each its native copy (what the native
/// decode step adds) where activations are float32.
fn materialize(
    pairs: &mut HashMap<(usize, Projection), Pair>,
    dtype: mlx_rs::Dtype,
) -> MlxResult<()> {
    let arrays: Vec<&Array> = pairs.values().flat_map(|p| [&p.a, &p.b_scaled]).collect();
    mlx_rs::transforms::eval(arrays)?;
    if dtype == mlx_rs::Dtype::Float32 {
        for pair in pairs.values_mut() {
            pair.native = Some(NativePair::new(&pair.a, &pair.b_scaled)?);
        }
    }
    Ok(())
}

/// Loads and validates the adapter in `dir` against `targets`; nothing is
/// kept unless every pair is complete and fits. `served` is the base model's
/// id, checked against the config's record when there is one.
pub fn load(
    id: &str,
    dir: &Path,
    served: &str,
    targets: &Targets,
) -> Result<Adapter, AdapterError> {
    validate_id(id)?;
    let config = read_config(dir)?;
    if let Some(recorded) = &config.base_model
        && !recorded_base_fits(recorded, served, targets)
    {
        return Err(AdapterError::Invalid(format!(
            "adapter `{id}` was trained on `{recorded}`, not on the served model `{served}`"
        )));
    }
    let mlx = |e: mlx_rs::error::Exception| AdapterError::Io(config.weights.clone(), e.to_string());
    let tensors = Array::load_safetensors(&config.weights)
        .map_err(|e| AdapterError::Io(config.weights.clone(), e.to_string()))?;
    let (halves, skipped) = factor_halves(id, tensors, targets)?;
    let peft = config.format == "peft";
    let dtype = super::model::compute_dtype();
    let scale = Array::from_f32(config.scale);
    let mut pairs = HashMap::with_capacity(halves.len());
    let mut rank = None;
    for ((layer, projection), pair) in halves {
        let module = format!("model.layers.{layer}.{}", projection.module());
        let (Some(a), Some(b)) = pair else {
            return Err(AdapterError::Invalid(format!(
                "{module}: the adapter has only one of lora_a / lora_b"
            )));
        };
        let (a, b, r) = oriented_pair(&module, a, b, peft, targets[&(layer, projection)])?;
        if *rank.get_or_insert(r) != r {
            return Err(AdapterError::Invalid(format!(
                "{module}: rank {r} differs from the other modules' {}",
                rank.unwrap_or(0)
            )));
        }
        let a = a.as_dtype(dtype).map_err(mlx)?;
        let b_scaled = multiply(&b.as_dtype(dtype).map_err(mlx)?, &scale).map_err(mlx)?;
        pairs.insert(
            (layer, projection),
            Pair {
                a,
                b_scaled,
                native: None,
            },
        );
    }
    materialize(&mut pairs, dtype).map_err(mlx)?;
    let size_bytes = std::fs::metadata(&config.weights).map_or(0, |m| m.len());
    Ok(Adapter {
        info: AdapterInfo {
            id: id.to_owned(),
            path: dir.to_owned(),
            format: config.format,
            rank: rank.unwrap_or(config.rank),
            scale: config.scale,
            base_model: config.base_model,
            modules: pairs.len(),
            skipped_tensors: skipped,
            size_bytes,
        },
        pairs,
    })
}

/// [`apply`] with these stacks, as the residual every projection's output
/// goes through in the decoder's forward passes.
pub fn residual_of<'a>(
    stacks: &'a [&'a AdapterStack],
) -> impl Fn(Array, &Array, usize, Projection) -> MlxResult<Array> + 'a {
    move |y, x, layer, projection| apply(y, x, layer, projection, stacks)
}

/// Whether any adapter of `stacks` changes one of `projections` of `layer`
/// (a fused kernel that skips the separate projections may serve them only
/// if none does).
pub fn touches(stacks: &[&AdapterStack], layer: usize, projections: &[Projection]) -> bool {
    stacks.iter().any(|stack| {
        stack.iter().any(|a| {
            projections
                .iter()
                .any(|&p| a.pairs.contains_key(&(layer, p)))
        })
    })
}

/// Adds each sequence's adapter residuals to `y = base(x)`, `x` being
/// `[B, L, in]` with one stack per sequence. Sequences sharing one stack
/// (the common case) are done as one batch; a mixed batch row by row.
pub fn apply(
    y: Array,
    x: &Array,
    layer: usize,
    projection: Projection,
    stacks: &[&AdapterStack],
) -> MlxResult<Array> {
    let key = (layer, projection);
    if !touches(stacks, layer, &[projection]) {
        return Ok(y);
    }
    // `base + (x A) B_scaled` as one fused op per adapter (addmm): on CPU
    // the cost of a decode step's small matmuls is mostly per-op overhead.
    let residual = |base: Array, x: &Array, stack: &AdapterStack| -> MlxResult<Array> {
        let mut out = base;
        for adapter in stack {
            if let Some(pair) = adapter.pairs.get(&key) {
                out = addmm(&out, matmul(x, &pair.a)?, &pair.b_scaled, 1.0, 1.0)?;
            }
        }
        Ok(out)
    };
    let first = stacks[0];
    if stacks.iter().all(|s| same_stack(s, first)) {
        return residual(y, x, first);
    }
    let mut rows = Vec::with_capacity(stacks.len());
    for (b, stack) in stacks.iter().enumerate() {
        let b = b as i32;
        rows.push(residual(y.index(b..b + 1), &x.index(b..b + 1), stack)?);
    }
    concatenate(&rows, 0)
}

/// Whether the native decode step can add every residual of `stack`.
pub fn is_native(stack: &AdapterStack) -> bool {
    stack
        .iter()
        .all(|adapter| adapter.pairs.values().all(|pair| pair.native.is_some()))
}

/// Adds `stack`'s residuals on `(layer, projection)` to one row:
/// `y += (x A) B_scaled` per adapter, in stacking order, as the MLX path's
/// `addmm` does (the inner products first, in f32, then the update). For
/// stacks that [`is_native`] accepts.
pub fn add_native(
    stack: &AdapterStack,
    layer: usize,
    projection: Projection,
    x: &[f32],
    y: &mut [f32],
) {
    let key = (layer, projection);
    for adapter in stack {
        if let Some(native) = adapter.pairs.get(&key).and_then(|p| p.native.as_ref()) {
            low_rank_update(native, x, y);
        }
    }
}

/// `y += (x a) b` for one row, through the widest instructions the CPU has.
fn low_rank_update(pair: &NativePair, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA, checked just above.
        return unsafe { low_rank_update_fma(pair, x, y) };
    }
    low_rank_update_with(pair, x, y, |a, b, c| c + a * b);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn low_rank_update_fma(pair: &NativePair, x: &[f32], y: &mut [f32]) {
    low_rank_update_with(pair, x, y, f32::mul_add);
}

/// The update with `fma(a, b, c) = a * b + c`; inlined into each caller so
/// the loops vectorize for its instruction set.
#[inline(always)]
fn low_rank_update_with(
    pair: &NativePair,
    x: &[f32],
    y: &mut [f32],
    fma: impl Fn(f32, f32, f32) -> f32 + Copy,
) {
    const LANES: usize = 16;
    let (input, output) = (x.len(), y.len());
    for j in 0..pair.rank {
        // Lanes summed apart, then together: independent chains vectorize.
        let row = &pair.a_t[j * input..(j + 1) * input];
        let mut lanes = [0.0f32; LANES];
        let (row_chunks, row_rest) = row.as_chunks::<LANES>();
        let (x_chunks, x_rest) = x.as_chunks::<LANES>();
        for (r, v) in row_chunks.iter().zip(x_chunks) {
            for i in 0..LANES {
                lanes[i] = fma(r[i], v[i], lanes[i]);
            }
        }
        let mut t = lanes.iter().sum::<f32>();
        for (r, v) in row_rest.iter().zip(x_rest) {
            t = fma(*r, *v, t);
        }
        let b = &pair.b_scaled[j * output..(j + 1) * output];
        for (y, b) in y.iter_mut().zip(b) {
            *y = fma(t, *b, *y);
        }
    }
}

fn same_stack(a: &AdapterStack, b: &AdapterStack) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Rc::ptr_eq(x, y))
}

/// The key an adapter stack gives prompt caches: ids joined by `+`.
pub fn stack_key(stack: &AdapterStack) -> String {
    stack
        .iter()
        .map(|a| a.info.id.as_str())
        .collect::<Vec<_>>()
        .join("+")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_and_ids() {
        assert_eq!(parse_spec("a+b").unwrap(), vec!["a", "b"]);
        assert_eq!(parse_spec(" a , b ").unwrap(), vec!["a", "b"]);
        assert!(parse_spec("none").unwrap().is_empty() && parse_spec("").unwrap().is_empty());
        assert!(parse_spec("a+a").unwrap_err().contains("twice"));
        assert!(
            parse_spec(&"a+".repeat(200_000))
                .unwrap_err()
                .contains("twice")
        );
        let many: Vec<String> = (0..=MAX_STACK).map(|i| format!("a{i}")).collect();
        assert!(
            parse_spec(&many.join("+"))
                .unwrap_err()
                .contains("too many")
        );
        assert_eq!(
            parse_spec(&many[..MAX_STACK].join("+")).unwrap().len(),
            MAX_STACK
        );
        assert!(parse_spec("a+../x").is_err());
        assert!(validate_id("sft-v2.1").is_ok());
        for bad in ["a+b", "a,b", "", "none", "../x", &"x".repeat(65)] {
            assert!(validate_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tensor_names_of_both_formats() {
        let q = Some((3, Projection::Q, true));
        assert_eq!(
            parse_tensor_name("model.layers.3.self_attn.q_proj.lora_a"),
            q
        );
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            q
        );
        assert_eq!(
            parse_tensor_name("language_model.model.layers.3.self_attn.q_proj.lora_a"),
            q
        );
        assert_eq!(
            parse_tensor_name(
                "base_model.model.language_model.model.layers.0.mlp.down_proj.lora_B.weight"
            ),
            Some((0, Projection::Down, false))
        );
        assert_eq!(
            parse_tensor_name("model.layers.3.self_attn.rotary.lora_a"),
            None
        );
        assert_eq!(parse_tensor_name("lm_head.lora_a"), None);
    }

    #[test]
    fn base_model_records() {
        assert!(same_base_model(
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "SmolLM2-135M-Instruct"
        ));
        assert!(same_base_model(
            ".deps/reference/SmolLM2-135M-Instruct.Q4_1-mlx",
            "SmolLM2-135M-Instruct"
        ));
        assert!(!same_base_model(
            "google/gemma-3-270m",
            "SmolLM2-135M-Instruct"
        ));
    }
}
