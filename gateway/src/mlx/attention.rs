//! Scaled dot-product attention on MLX, routed for the backend.
//!
//! On CUDA, MLX hands its fused attention to cuDNN where the process allows
//! it (`MLX_CUDA_USE_CUDNN_SDPA`, on unless set to 0). cuDNN attends over a
//! long prompt 12-19x faster than MLX's own kernels (an H200, 1,810-4,096
//! queries; the 8B's prefill 1.4-1.6x), but it builds a plan for every new
//! shape (about 40 ms in a probe), and MLX also gives it single-query steps
//! over keys that look like a slice of its own caches, which it reads from
//! the buffer's start (so MLX 0.32's code reads; wrong for a slab row that
//! starts later). So on CUDA only a long causal
//! prompt goes to cuDNN, padded to shapes in steps of [`CUDNN_STEP`] so
//! that a few plans serve every length; everything else runs MLX's unfused
//! attention, written out here as MLX writes its fallback. Elsewhere MLX's
//! fused op runs as it is.

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::fast::{ScaledDotProductAttentionMask, scaled_dot_product_attention};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{
    arange, concatenate, expand_dims, ge, select, softmax_axis, unflatten, zeros_dtype,
};
use mlx_rs::{Array, Dtype};

use super::Backend;

/// What a query may attend to besides its sequence's keys.
#[derive(Clone, Copy)]
pub enum Mask<'a> {
    /// Every key.
    None,
    /// Keys up to its own position, the last query aligned with the last key.
    Causal,
    /// Where this boolean array (broadcast to `[B, heads, queries, keys]`) is true.
    Array(&'a Array),
}

/// Prompts padded for cuDNN grow to a multiple of this many queries and keys.
pub const CUDNN_STEP: usize = 256;

/// The fewest queries sent to cuDNN when `MLXGATE_CUDNN_MIN_QUERIES` is unset.
const CUDNN_MIN_QUERIES: usize = 256;

/// How one attention call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// MLX's fused op, as it chooses.
    Fused,
    /// cuDNN, through MLX's fused op, padded to [`CUDNN_STEP`] shapes.
    Padded,
    /// MLX's unfused ops, as its fallback would run them.
    Unfused,
}

/// The fewest queries of a causal prompt that go to cuDNN on CUDA, or `None`
/// where MLX never uses cuDNN (another backend, `MLX_CUDA_USE_CUDNN_SDPA=0`)
/// and its fused op is safe everywhere. `MLXGATE_CUDNN_MIN_QUERIES=0` sends
/// no prompt to cuDNN (`usize::MAX`), but MLX may still use it, so the
/// other calls stay routed away from it.
pub fn cudnn_min_queries() -> Option<usize> {
    static MIN: OnceLock<Option<usize>> = OnceLock::new();
    *MIN.get_or_init(|| {
        let allowed = std::env::var("MLX_CUDA_USE_CUDNN_SDPA").map_or(true, |v| v.trim() != "0");
        let min = std::env::var("MLXGATE_CUDNN_MIN_QUERIES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(CUDNN_MIN_QUERIES);
        let min = if min == 0 { usize::MAX } else { min };
        (allowed && Backend::detect() == Backend::Cuda).then_some(min)
    })
}

/// Whether MLX may hand attention to cuDNN in this process.
pub fn cudnn_in_use() -> bool {
    cudnn_min_queries().is_some()
}

/// The route for queries `q` (`[B, heads, queries, head_dim]`) under `mask`,
/// where cuDNN takes causal prompts of at least `cudnn_min` queries (`None`:
/// cuDNN is not in use).
fn route(q: &Array, mask: Mask<'_>, cudnn_min: Option<usize>) -> Route {
    let Some(min) = cudnn_min else {
        return Route::Fused;
    };
    let shape = q.shape();
    let (batch, queries, head_dim) = (shape[0], shape[2] as usize, shape[3]);
    // The shapes cuDNN's attention takes (MLX checks the same).
    let cudnn_takes = matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        && head_dim % 8 == 0
        && head_dim <= 128;
    if matches!(mask, Mask::Causal) && batch == 1 && queries >= min && cudnn_takes {
        Route::Padded
    } else {
        Route::Unfused
    }
}

/// Attention of `q` (`[B, heads, queries, head_dim]`) over `k` and `v`
/// (`[B, kv_heads, keys, head_dim]`, `heads` a multiple of `kv_heads`):
/// `[B, heads, queries, head_dim]`.
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Mask<'_>,
) -> Result<Array, Exception> {
    match route(q, mask, cudnn_min_queries()) {
        Route::Fused => fused(q, k, v, scale, mask),
        Route::Padded => padded_causal(q, k, v, scale),
        Route::Unfused => unfused(q, k, v, scale, mask),
    }
}

/// MLX's fused op.
fn fused(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask<'_>) -> Result<Array, Exception> {
    let mask = match mask {
        Mask::None => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Array(mask) => Some(ScaledDotProductAttentionMask::Array(mask)),
    };
    scaled_dot_product_attention(q, k, v, scale, mask, None)
}

/// Causal attention of one sequence through the fused op, queries and keys
/// padded so that both counts are multiples of [`CUDNN_STEP`] (cuDNN's
/// plans are per shape). The mask aligns the last query with the last key,
/// so padding both at the end keeps every real query's keys; queries added
/// in front (to round their count) see only keys before the first real
/// query's. The padded rows are dropped.
fn padded_causal(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array, Exception> {
    let (queries, keys) = (q.shape()[2] as usize, k.shape()[2] as usize);
    let cached = keys - queries;
    let back = keys.next_multiple_of(CUDNN_STEP) - keys;
    // Front rows see the first `cached - front` keys: at most `cached` of them.
    let front = ((queries + back).next_multiple_of(CUDNN_STEP) - queries - back).min(cached);
    let pad = |x: &Array, front: usize, back: usize| -> Result<Array, Exception> {
        if front + back == 0 {
            return Ok(x.clone());
        }
        let mut parts = Vec::with_capacity(3);
        let mut shape = x.shape().to_vec();
        if front > 0 {
            shape[2] = front as i32;
            parts.push(zeros_dtype(&shape, x.dtype())?);
        }
        parts.push(x.clone());
        if back > 0 {
            shape[2] = back as i32;
            parts.push(zeros_dtype(&shape, x.dtype())?);
        }
        concatenate(&parts, 2)
    };
    let out = fused(
        &pad(q, front, back)?,
        &pad(k, 0, back)?,
        &pad(v, 0, back)?,
        scale,
        Mask::Causal,
    )?;
    if front + back == 0 {
        return Ok(out);
    }
    Ok(out.index((.., .., front as i32..(front + queries) as i32, ..)))
}

/// The most negative finite value of `dtype`, which masked scores take (as
/// MLX's fallback does: a row that masks everything stays finite).
fn lowest(dtype: Dtype) -> Array {
    match dtype {
        // bfloat16's largest finite value, 0x7F7F, widened.
        Dtype::Bfloat16 => Array::from_f32(-f32::from_bits(0x7F7F_0000)).as_dtype(dtype),
        Dtype::Float16 => Array::from_f32(-65504.0).as_dtype(dtype),
        _ => Array::from_f32(f32::MIN).as_dtype(dtype),
    }
    .expect("a scalar converts to a float dtype")
}

/// Attention by MLX's separate ops, as its fallback for the fused op runs
/// it: scaled queries grouped by key/value head, scores by a broadcast
/// matmul, masked, a softmax in float32, a matmul.
fn unfused(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Mask<'_>,
) -> Result<Array, Exception> {
    let dtype = q.dtype();
    let (heads, kv_heads) = (q.shape()[1], k.shape()[1]);
    let repeats = heads / kv_heads;
    let mut q = Array::from_f32(scale).as_dtype(dtype)?.multiply(q)?;
    let (mut k, mut v) = (k.clone(), v.clone());
    if repeats > 1 {
        q = unflatten(&q, 1, &[kv_heads, repeats])?;
        k = expand_dims(&k, 2)?;
        v = expand_dims(&v, 2)?;
    }
    let mut scores = q.matmul(k.swap_axes(-1, -2)?)?;
    let allowed = match mask {
        Mask::None => None,
        Mask::Causal => {
            let (queries, keys) = (q.shape()[q.ndim() - 2], k.shape()[k.ndim() - 2]);
            let rows = expand_dims(arange::<_, i32>(keys - queries, keys, None)?, 1)?;
            let columns = expand_dims(arange::<_, i32>(0, keys, None)?, 0)?;
            Some(ge(&rows, &columns)?)
        }
        Mask::Array(mask)
            if repeats > 1 && mask.ndim() >= 3 && mask.shape()[mask.ndim() - 3] != 1 =>
        {
            Some(unflatten(mask, -3, &[kv_heads, repeats])?)
        }
        Mask::Array(mask) if repeats > 1 && mask.ndim() >= 3 => Some(expand_dims(mask, -3)?),
        Mask::Array(mask) => Some(mask.clone()),
    };
    if let Some(allowed) = allowed {
        // Added rather than selected: the same scores (a finite lowest plus a
        // score rounds back to it), but on an H200 `select` over the
        // broadcast mask took 1.0 of a layer's 2.2 ms at 4,096 queries, and
        // 28 layers' attention at 1,810 took 23 ms with `add`, 32 with it
        // (the same ops in Python MLX: scripts/gpu/prefill_attention_probe.py).
        let dtype = scores.dtype();
        let bias = select(
            &allowed,
            Array::from_f32(0.0).as_dtype(dtype)?,
            lowest(dtype),
        )?;
        scores = scores.add(&bias)?;
    }
    let out = softmax_axis(&scores, -1, true)?.matmul(&v)?;
    if repeats > 1 {
        let shape = out.shape();
        let (batch, queries, dim) = (shape[0], shape[3], shape[4]);
        return out.reshape(&[batch, heads, queries, dim]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    fn normal(shape: &[i32], key: u64) -> Array {
        let key = random::key(key).unwrap();
        random::normal::<f32>(shape, None, None, Some(&key)).unwrap()
    }

    fn max_difference(a: &Array, b: &Array) -> f32 {
        assert_eq!(a.shape(), b.shape());
        let d = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
        d.item_exact::<f32>()
    }

    /// One sequence: 8 query heads over 2 key/value heads of width 16.
    fn sequence(queries: i32, keys: i32) -> (Array, Array, Array) {
        (
            normal(&[1, 8, queries, 16], 1),
            normal(&[1, 2, keys, 16], 2),
            normal(&[1, 2, keys, 16], 3),
        )
    }

    #[test]
    fn unfused_matches_the_fused_op_for_every_mask() {
        let (q, k, v) = sequence(37, 50);
        let allowed = normal(&[1, 1, 37, 50], 4)
            .gt(Array::from_f32(-0.5))
            .unwrap();
        for mask in [Mask::None, Mask::Causal, Mask::Array(&allowed)] {
            let want = fused(&q, &k, &v, 0.25, mask).unwrap();
            let got = unfused(&q, &k, &v, 0.25, mask).unwrap();
            assert!(max_difference(&want, &got) < 1e-5);
        }
    }

    #[test]
    fn padding_for_cudnn_keeps_every_real_query_exact() {
        // A fresh prompt, one after a cached prefix (rows padded in front),
        // one whose front padding is capped by a short prefix, and one
        // already on the step.
        for (queries, keys) in [(300, 300), (300, 1000), (500, 520), (256, 512)] {
            let (q, k, v) = sequence(queries, keys);
            let want = fused(&q, &k, &v, 0.25, Mask::Causal).unwrap();
            let got = padded_causal(&q, &k, &v, 0.25).unwrap();
            assert!(
                max_difference(&want, &got) < 1e-5,
                "{queries} queries over {keys} keys"
            );
        }
    }

    #[test]
    fn padded_half_precision_attention_stays_close_to_float32() {
        // The dtype and head width that take `padded_causal` to cuDNN on a
        // GPU (where its causal mask is bottom-right aligned, which the
        // front padding after a cached prefix relies on); on a CPU, MLX's
        // own op. Against float32 attention of the same bf16 inputs.
        for (queries, keys) in [(300, 300), (300, 1000), (500, 520)] {
            let q = normal(&[1, 8, queries, 64], 5)
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            let k = normal(&[1, 2, keys, 64], 6)
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            let v = normal(&[1, 2, keys, 64], 7)
                .as_dtype(Dtype::Bfloat16)
                .unwrap();
            let wide = |x: &Array| x.as_dtype(Dtype::Float32).unwrap();
            let want = unfused(&wide(&q), &wide(&k), &wide(&v), 0.125, Mask::Causal).unwrap();
            let got = padded_causal(&q, &k, &v, 0.125).unwrap();
            let difference = max_difference(&want, &wide(&got));
            // bf16 keeps 8 bits of mantissa: outputs of size ~1 round by ~0.004.
            assert!(
                difference < 0.03,
                "{queries} queries over {keys} keys: {difference}"
            );
        }
    }

    #[test]
    fn only_long_causal_prompts_in_half_precision_go_to_cudnn() {
        let prompt = Array::zeros::<f32>(&[1, 8, 300, 64])
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let step = Array::zeros::<f32>(&[1, 8, 1, 64])
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let allowed = Array::from_bool(true);
        assert_eq!(route(&prompt, Mask::Causal, Some(256)), Route::Padded);
        assert_eq!(route(&prompt, Mask::Causal, Some(512)), Route::Unfused);
        assert_eq!(
            route(&prompt, Mask::Array(&allowed), Some(256)),
            Route::Unfused
        );
        assert_eq!(route(&step, Mask::None, Some(256)), Route::Unfused);
        let float32 = Array::zeros::<f32>(&[1, 8, 300, 64]).unwrap();
        assert_eq!(route(&float32, Mask::Causal, Some(256)), Route::Unfused);
        assert_eq!(route(&prompt, Mask::Causal, None), Route::Fused);
    }
}
