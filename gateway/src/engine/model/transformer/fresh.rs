//! Prompts with nothing cached yet, in one left-padded batch (the arrivals a
//! GPU prefills together), attending in one masked call for the whole batch
//! instead of one call per prompt (32 prompts of a 28-layer model make 896
//! calls). Opt-in (`MLXGATE_FRESH_TOGETHER=1`): on an H100 it measured no
//! gain (passes of 17-32 arrivals: 551 ms against 436 one by one with
//! cuDNN's attention, 328 against 299 with MLX's; BENCHMARKS.md).

use mlx_rs::Array;
use mlx_rs::ops::logical_or;

use super::super::kv_cache::KvCache;
use super::super::weights::MlxResult;

/// Whether models load with fresh prompts attending together: only when
/// `MLXGATE_FRESH_TOGETHER=1` (`Transformer::attend_fresh_together` sets
/// it on a loaded model).
pub(super) fn asked() -> bool {
    std::env::var("MLXGATE_FRESH_TOGETHER").is_ok_and(|v| v == "1")
}

/// The fresh rows of a batch and the mask they attend under.
pub(super) struct FreshRows {
    /// `rows[b]`: row `b` had nothing cached (its cache offset was 0).
    pub rows: Vec<bool>,
    /// `[B, 1, L, L]`: query `i` of row `b` sees key `j <= i` of its own
    /// tokens (`j >= pads[b]`). A padding query sees only its own key: a
    /// query that sees nothing has no softmax (NaN), which would reach the
    /// row's later layers through its keys and values.
    mask: Array,
    /// Query position minus key position, `[L, L]`, for windowed layers.
    distance: Array,
}

impl FreshRows {
    /// The fresh rows of a pass of `length` columns whose rows hold
    /// `lengths[b]` tokens each (left-padded), when at least two are fresh
    /// and there is more than one column (a decode step has one).
    pub fn of(
        caches: &[&mut KvCache],
        lengths: &[i32],
        length: i32,
    ) -> MlxResult<Option<FreshRows>> {
        if length < 2 {
            return Ok(None);
        }
        let rows: Vec<bool> = caches.iter().map(|cache| cache.offset == 0).collect();
        if rows.iter().filter(|&&fresh| fresh).count() < 2 {
            return Ok(None);
        }
        let positions = Array::arange::<_, i32>(None, length, None)?;
        let queries = positions.reshape(&[length, 1])?;
        let keys = positions.reshape(&[1, length])?;
        let pads: Vec<i32> = lengths.iter().map(|&n| length - n).collect();
        let pads = Array::from_slice(&pads, &[pads.len() as i32, 1, 1, 1]);
        let seen = keys.le(&queries)?.logical_and(keys.ge(&pads)?)?;
        let mask = logical_or(&seen, keys.eq(&queries)?)?;
        let distance = queries.subtract(&keys)?;
        Ok(Some(FreshRows {
            rows,
            mask,
            distance,
        }))
    }

    /// Every row is fresh: the batched output needs no rows picked out.
    pub fn all(&self) -> bool {
        self.rows.iter().all(|&fresh| fresh)
    }

    /// The mask for a layer that sees the last `window` positions (all of
    /// them where `None`, or where the window is wider than the pass).
    pub fn mask(&self, window: Option<usize>) -> MlxResult<Array> {
        let length = self.distance.shape()[0] as usize;
        match window.filter(|&w| w < length) {
            Some(w) => self
                .mask
                .logical_and(self.distance.lt(Array::from_int(w as i32))?),
            None => Ok(self.mask.clone()),
        }
    }
}
