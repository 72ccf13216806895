//! Which part of each layer a rank holds (tensor parallelism, Megatron /
//! mlx-lm layout): q/k/v and gate/up split by output rows, o and down by
//! input columns followed by an all-sum.
//!
//! Attention splits whole GQA groups (one kv head with its query heads), so
//! odd query-head counts are fine (SmolLM2: 9 heads, 3 kv heads). The split
//! may be uneven: rank r holds kv heads [r*K/N, (r+1)*K/N), which gives rank
//! 0 (which also computes the logits and samples) the smaller share. With
//! fewer kv heads than ranks, or o_proj column bounds that miss the storage's
//! quantization groups, attention is replicated on every rank (no collective
//! after it) and only the MLP is split. The MLP splits in units of `align`
//! columns (a multiple of 32: the native kernels need K % 32 == 0, and every
//! GGUF type is carried as affine groups of 32, or 16 for Q6_K).
//!
//! Every rank computes the same plan from the same global facts, so every
//! rank takes the same decisions.

use std::ops::Range;

use crate::engine::model::LoadError;
use crate::engine::model::config::ModelConfig;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttentionShard {
    /// This rank's kv heads (its query heads follow: `kv * group`).
    Split { kv: Range<usize> },
    /// Every rank holds and computes all heads.
    Replicated { why: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    pub rank: usize,
    pub world: usize,
    pub attention: AttentionShard,
    /// This rank's intermediate features (gate/up rows, down columns).
    pub ffn: Range<usize>,
    /// Query heads per kv head.
    group: usize,
    head_dim: usize,
    kv_heads: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("rank {rank} is not below the group size {world}")]
    BadRank { rank: usize, world: usize },
    #[error("{heads} query heads are not a multiple of {kv_heads} kv heads")]
    BadGqa { heads: usize, kv_heads: usize },
    #[error("intermediate size {size} has {units} units of {align}: fewer than {world} ranks")]
    FfnTooSmall {
        size: usize,
        units: usize,
        align: usize,
        world: usize,
    },
    #[error("intermediate size {size} is not a multiple of {align}")]
    FfnUnaligned { size: usize, align: usize },
}

/// Part `rank` of `units` split `world` ways, contiguous, sizes differing by
/// at most one, smaller parts first.
pub fn part(units: usize, rank: usize, world: usize) -> Range<usize> {
    (rank * units / world)..((rank + 1) * units / world)
}

impl ShardPlan {
    /// `o_group`: quantization group of o_proj's stored columns (0 when
    /// dense); `ffn_align`: column unit of down_proj (32, or the checkpoint's
    /// group size if larger).
    pub fn new(
        c: &ModelConfig,
        rank: usize,
        world: usize,
        o_group: usize,
        ffn_align: usize,
    ) -> Result<ShardPlan, PlanError> {
        if rank >= world || world == 0 {
            return Err(PlanError::BadRank { rank, world });
        }
        if c.kv_heads == 0 || !c.heads.is_multiple_of(c.kv_heads) {
            return Err(PlanError::BadGqa {
                heads: c.heads,
                kv_heads: c.kv_heads,
            });
        }
        let group = c.heads / c.kv_heads;
        let splittable = c.kv_heads >= world
            && (0..=world).all(|r| {
                // Every rank's first q column (and the end) on a group bound.
                let kv_start = r * c.kv_heads / world;
                let col = kv_start * group * c.head_dim;
                o_group == 0 || col.is_multiple_of(o_group)
            });
        let attention = if splittable {
            AttentionShard::Split {
                kv: part(c.kv_heads, rank, world),
            }
        } else {
            AttentionShard::Replicated {
                why: if c.kv_heads < world {
                    format!("{} kv heads < {world} ranks", c.kv_heads)
                } else {
                    format!("o_proj columns miss its groups of {o_group}")
                },
            }
        };
        let align = ffn_align.max(32);
        let size = c.intermediate_size;
        if !size.is_multiple_of(align) {
            return Err(PlanError::FfnUnaligned { size, align });
        }
        let units = size / align;
        if units < world {
            return Err(PlanError::FfnTooSmall {
                size,
                units,
                align,
                world,
            });
        }
        let ffn = part(units, rank, world);
        Ok(ShardPlan {
            rank,
            world,
            attention,
            ffn: ffn.start * align..ffn.end * align,
            group,
            head_dim: c.head_dim,
            kv_heads: c.kv_heads,
        })
    }

    /// [`ShardPlan::new`] for a model being loaded: `o_group` and
    /// `down_group` are the quantization groups of o_proj and down_proj as
    /// stored (0 when dense); an error says the model cannot be split.
    pub fn for_load(
        c: &ModelConfig,
        rank: usize,
        world: usize,
        o_group: usize,
        down_group: usize,
    ) -> Result<ShardPlan, LoadError> {
        ShardPlan::new(c, rank, world, o_group, down_group).map_err(|e| LoadError::ShapeMismatch {
            name: "model".into(),
            detail: format!("cannot split over {world} processes: {e}"),
        })
    }

    pub fn attention_is_split(&self) -> bool {
        matches!(self.attention, AttentionShard::Split { .. })
    }

    /// This rank's kv heads (all of them when replicated).
    pub fn kv_heads(&self) -> Range<usize> {
        match &self.attention {
            AttentionShard::Split { kv } => kv.clone(),
            AttentionShard::Replicated { .. } => 0..self.kv_heads,
        }
    }

    /// Rows of q_proj (and its bias), = columns of o_proj.
    pub fn q_rows(&self) -> Range<usize> {
        let kv = self.kv_heads();
        let per_kv = self.group * self.head_dim;
        kv.start * per_kv..kv.end * per_kv
    }

    /// Rows of k_proj and v_proj (and their biases).
    pub fn kv_rows(&self) -> Range<usize> {
        let kv = self.kv_heads();
        kv.start * self.head_dim..kv.end * self.head_dim
    }

    /// Whether row-parallel biases (o, down) are kept here: on rank 0 only,
    /// so the all-sum adds each once.
    pub fn keeps_row_parallel_bias(&self) -> bool {
        self.rank == 0
    }

    /// The config this rank's forward pass reshapes with.
    pub fn local_config(&self, c: &ModelConfig) -> ModelConfig {
        let kv = self.kv_heads();
        ModelConfig {
            heads: kv.len() * self.group,
            kv_heads: kv.len(),
            intermediate_size: self.ffn.len(),
            ..c.clone()
        }
    }

    /// For logs.
    pub fn label(&self) -> String {
        let attention = match &self.attention {
            AttentionShard::Split { kv } => format!("kv heads {}..{}", kv.start, kv.end),
            AttentionShard::Replicated { why } => format!("attention replicated ({why})"),
        };
        format!(
            "rank {} of {}: {attention}, ffn {}..{}",
            self.rank, self.world, self.ffn.start, self.ffn.end
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::model::config::Family;

    pub(crate) fn config(
        heads: usize,
        kv_heads: usize,
        hidden: usize,
        intermediate: usize,
    ) -> ModelConfig {
        ModelConfig {
            family: Family::Llama,
            hidden_size: hidden,
            intermediate_size: intermediate,
            layers: 2,
            heads,
            kv_heads,
            head_dim: 64,
            vocab_size: 1000,
            context_length: 2048,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_local_theta: 10000.0,
            rope_scale: 1.0,
            rope_traditional: false,
            tie_word_embeddings: true,
            sliding_window: None,
            sliding_window_pattern: 6,
            query_pre_attn_scalar: None,
            norm_weight_offset: 0.0,
            quantization: None,
        }
    }

    #[test]
    fn smollm2_splits_its_three_kv_groups_one_to_two() {
        let c = config(9, 3, 576, 1536);
        let r0 = ShardPlan::new(&c, 0, 2, 32, 32).unwrap();
        let r1 = ShardPlan::new(&c, 1, 2, 32, 32).unwrap();
        assert_eq!((r0.kv_heads(), r1.kv_heads()), (0..1, 1..3));
        assert_eq!((r0.q_rows(), r1.q_rows()), (0..192, 192..576));
        assert_eq!((r0.kv_rows(), r1.kv_rows()), (0..64, 64..192));
        assert_eq!((r0.ffn.clone(), r1.ffn.clone()), (0..768, 768..1536));
        assert_eq!(r0.local_config(&c).heads, 3);
        assert_eq!(r1.local_config(&c).heads, 6);
        // Four ranks: 3 kv heads cannot go round; the MLP still splits.
        let r3 = ShardPlan::new(&c, 3, 4, 32, 32).unwrap();
        assert!(!r3.attention_is_split());
        assert_eq!(r3.ffn, 1152..1536);
    }

    #[test]
    fn qwen25_half_splits_on_32_groups_but_not_on_k_quant_super_blocks() {
        let c = config(14, 2, 896, 4864);
        let r1 = ShardPlan::new(&c, 1, 2, 32, 32).unwrap();
        assert_eq!(r1.q_rows(), 448..896);
        assert_eq!(r1.ffn, 2432..4864);
        assert_eq!(r1.ffn.start % 32, 0);
        assert_ne!(
            r1.ffn.start % 256,
            0,
            "down_proj's Q6_K/Q4_K super-blocks straddle the cut"
        );
        let r3 = ShardPlan::new(&c, 3, 4, 32, 32).unwrap();
        assert!(!r3.attention_is_split());
        assert_eq!(r3.ffn, 3648..4864);
    }

    #[test]
    fn gemma3_270m_replicates_its_single_kv_head() {
        let mut c = config(4, 1, 640, 2048);
        c.head_dim = 256;
        let plan = ShardPlan::new(&c, 0, 2, 32, 32).unwrap();
        assert!(!plan.attention_is_split());
        assert_eq!(plan.q_rows(), 0..1024);
        assert_eq!(plan.ffn, 0..1024);
    }

    #[test]
    fn unaligned_o_columns_fall_back_to_replicated_attention() {
        // Group-128 storage, head_dim 64, 7 q heads per rank: 448 % 128 != 0.
        let c = config(14, 2, 896, 4864);
        let plan = ShardPlan::new(&c, 0, 2, 128, 128).unwrap();
        assert!(!plan.attention_is_split());
        assert_eq!(plan.ffn, 0..2432);
    }

    #[test]
    fn every_rank_gets_a_part_and_parts_tile_the_whole() {
        for (units, world) in [(3, 2), (48, 2), (152, 4), (7, 7)] {
            let parts: Vec<_> = (0..world).map(|r| part(units, r, world)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[world - 1].end, units);
            assert!(parts.windows(2).all(|p| p[0].end == p[1].start));
            assert!(parts.iter().all(|p| !p.is_empty()));
        }
    }
}
