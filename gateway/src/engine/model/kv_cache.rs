//! Per-sequence key/value cache: one entry per layer.
//!
//! Plain layers keep every position; sliding-window layers keep only the last
//! `window - 1` positions between steps (a rotating cache in effect), which is
//! all a future query can attend to. The arrays and offsets are plain data so
//! a cache can be exported and imported (prompt caches build on this).

use mlx_rs::Array;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;

use super::weights::MlxResult;

/// One layer's cached keys and values, `[1, kv_heads, positions, head_dim]`.
#[derive(Clone, Default)]
pub struct LayerCache {
    pub keys: Option<Array>,
    pub values: Option<Array>,
    /// Keep at most this many positions after a step (sliding layers).
    pub window: Option<usize>,
    /// Absolute position of the first cached entry.
    pub start: usize,
}

impl LayerCache {
    /// Positions currently held.
    pub fn len(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends this step's keys/values; returns everything to attend over.
    pub fn append(&mut self, keys: Array, values: Array) -> MlxResult<(Array, Array)> {
        let (keys, values) = match (self.keys.take(), self.values.take()) {
            (Some(old_k), Some(old_v)) => (
                concatenate(&[old_k, keys], 2)?,
                concatenate(&[old_v, values], 2)?,
            ),
            _ => (keys, values),
        };
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        Ok((keys, values))
    }

    /// Drops positions no later query can see (sliding layers only).
    pub fn trim(&mut self) -> MlxResult<()> {
        let Some(window) = self.window else {
            return Ok(());
        };
        let keep = window.saturating_sub(1);
        let len = self.len();
        if len <= keep {
            return Ok(());
        }
        let cut = (len - keep) as i32;
        if let (Some(keys), Some(values)) = (&self.keys, &self.values) {
            self.keys = Some(keys.index((.., .., cut.., ..)));
            self.values = Some(values.index((.., .., cut.., ..)));
        }
        self.start += cut as usize;
        Ok(())
    }
}

/// The cache of one sequence across all layers.
#[derive(Clone, Default)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
    /// Tokens processed so far (the next token's absolute position).
    pub offset: usize,
}

impl KvCache {
    pub fn new(windows: impl IntoIterator<Item = Option<usize>>) -> KvCache {
        KvCache {
            layers: windows
                .into_iter()
                .map(|window| LayerCache {
                    window,
                    ..LayerCache::default()
                })
                .collect(),
            offset: 0,
        }
    }

    /// Arrays to evaluate with the step's output, so the graph stays short.
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers
            .iter()
            .flat_map(|layer| layer.keys.iter().chain(layer.values.iter()))
    }

    /// Bytes held by the cache.
    pub fn nbytes(&self) -> usize {
        self.arrays().map(Array::nbytes).sum()
    }

    /// The longest prefix, of at most `tokens`, that [`KvCache::truncated`]
    /// can serve. A sliding-window layer that has dropped its oldest entries
    /// can only be reused whole: what a shorter prefix needs is gone.
    pub fn reusable(&self, tokens: usize) -> usize {
        let tokens = tokens.min(self.offset);
        let rotated = self.layers.iter().any(|l| l.start > 0);
        if rotated && tokens != self.offset {
            0
        } else {
            tokens
        }
    }

    /// This cache cut back to its first `tokens` positions (views, no copy).
    /// `tokens` must come from [`KvCache::reusable`].
    pub fn truncated(&self, tokens: usize) -> MlxResult<KvCache> {
        debug_assert_eq!(self.reusable(tokens), tokens);
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mut layer = layer.clone();
            if tokens < self.offset {
                let end = (tokens - layer.start) as i32;
                layer.keys = layer.keys.map(|k| k.index((.., .., ..end, ..)));
                layer.values = layer.values.map(|v| v.index((.., .., ..end, ..)));
                layer.trim()?;
            }
            layers.push(layer);
        }
        Ok(KvCache {
            layers,
            offset: tokens,
        })
    }
}
