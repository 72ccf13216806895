//! The in-memory tier: recent sequences' caches, keyed by their tokens,
//! adapter set and owner (tenant), least recently used dropped first once
//! over the byte budget. A lookup sees only the entries its [`CacheScope`]
//! reuses, so one tenant's prompts never shorten another's prefill.
//!
//! Entries share MLX arrays with nothing mutable: a sequence that goes on
//! after its cache was stored extends by concatenation into new arrays, so
//! an entry never changes under a later request.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{CacheScope, CacheStats, common_prefix};
use crate::engine::model::KvCache;

struct Entry {
    adapters: String,
    /// The tenant whose request cached it (`None`: the operator).
    owner: Option<String>,
    tokens: Vec<u32>,
    cache: KvCache,
    bytes: usize,
    last_used: u64,
}

/// A reusable prefix found for a prompt.
pub struct Reuse {
    /// A cache covering the first `tokens` tokens of the prompt.
    pub cache: KvCache,
    pub tokens: usize,
}

pub struct MemoryCache {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
    stats: Arc<CacheStats>,
}

impl MemoryCache {
    pub fn new(budget: usize, stats: Arc<CacheStats>) -> MemoryCache {
        MemoryCache {
            budget,
            entries: Vec::new(),
            clock: 0,
            stats,
        }
    }

    /// The longest cached prefix of `prompt` under `adapters` that `scope`
    /// may reuse, of at most `limit` tokens.
    pub fn lookup(
        &mut self,
        scope: &CacheScope,
        adapters: &str,
        prompt: &[u32],
        limit: usize,
    ) -> Option<Reuse> {
        let (index, tokens) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.adapters == adapters && scope.reuses(e.owner.as_deref()))
            .map(|(i, e)| {
                (
                    i,
                    e.cache
                        .reusable(common_prefix(&e.tokens, prompt).min(limit)),
                )
            })
            .max_by_key(|&(_, tokens)| tokens)?;
        if tokens == 0 {
            return None;
        }
        self.clock += 1;
        let entry = &mut self.entries[index];
        entry.last_used = self.clock;
        Some(Reuse {
            cache: entry.cache.truncated(tokens).ok()?,
            tokens,
        })
    }

    /// Keeps `cache`, which covers exactly `tokens`, as `scope`'s tenant's.
    /// Entries it supersedes (the same owner's, or any when shared; their
    /// tokens a prefix of these, and servable from this cache) go.
    pub fn insert(&mut self, scope: &CacheScope, adapters: &str, tokens: Vec<u32>, cache: KvCache) {
        // Kept past its sequence: in its own buffers, not a GPU batch's slab.
        let Ok(cache) = cache.detached() else {
            return;
        };
        let bytes = cache.nbytes();
        if tokens.is_empty() || bytes > self.budget || cache.offset != tokens.len() {
            return;
        }
        let owner = scope.tenant.clone();
        self.entries.retain(|e| {
            let covered = e.adapters == adapters
                && (scope.share || e.owner == owner)
                && e.tokens.len() <= tokens.len()
                && tokens.starts_with(&e.tokens)
                && cache.reusable(e.tokens.len()) == e.tokens.len();
            !covered
        });
        self.clock += 1;
        self.entries.push(Entry {
            adapters: adapters.to_owned(),
            owner,
            tokens,
            cache,
            bytes,
            last_used: self.clock,
        });
        while self.held() > self.budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i);
            match oldest {
                Some(i) => drop(self.entries.swap_remove(i)),
                None => break,
            }
        }
        self.publish();
    }

    fn held(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    fn publish(&self) {
        let stats = &self.stats;
        stats
            .memory_bytes
            .store(self.held() as u64, Ordering::Relaxed);
        stats
            .memory_entries
            .store(self.entries.len() as u64, Ordering::Relaxed);
    }
}
