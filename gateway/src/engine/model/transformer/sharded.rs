//! This process's part of a model split over several (tensor parallelism,
//! `engine::distributed`): its slices of each layer's projections, the
//! forward pass's head and feature counts cut to them, and an all-sum over
//! the group after o_proj (where attention is split) and after down_proj.
//! Norms, embeddings and the output head stay whole on every rank, so every
//! rank ends a step with the same logits and picks the same tokens.

use mlx_rs::Array;
use mlx_rs::error::Exception;

use super::{Attention, Block, Mlp, Transformer};
use crate::engine::distributed;
use crate::engine::distributed::plan::ShardPlan;
use crate::engine::distributed::shard::{column_parallel, row_parallel};
use crate::engine::model::LoadError;
use crate::engine::model::weights::{Kernel, Linear, MlxResult};
use crate::mlx::distributed::DistGroup;

/// Whether a sharded model's attention is split (else every rank computes
/// all heads and only the MLP is summed), and its plan. It sums over the
/// process's current group (`distributed::group`), which rank 0 replaces
/// when it forms the group again after losing a worker.
pub(super) struct TensorParallel {
    pub(super) attention_split: bool,
    plan: ShardPlan,
}

/// A quantized matrix's group size (its columns can only be cut on group
/// bounds); 0 when dense.
fn group_of(linear: &Linear) -> usize {
    match &linear.kernel {
        Kernel::Quantized { group_size, .. } => *group_size as usize,
        Kernel::Dense(_) => 0,
    }
}

impl Transformer {
    /// `y` summed over every rank where `summed` (a row-parallel
    /// projection's partial sums); unchanged on a model that is not split.
    pub(super) fn all_ranks(&self, y: Array, summed: bool) -> MlxResult<Array> {
        match &self.tp {
            Some(_) if summed => distributed::group()
                .ok_or_else(|| Exception::custom("the process group is gone"))?
                .all_sum(&y),
            _ => Ok(y),
        }
    }

    /// The plan of a split model (`None` when whole), for logs.
    pub fn shard_label(&self) -> Option<String> {
        self.tp.as_ref().map(|tp| tp.plan.label())
    }

    /// A model built from a rank's slices of the weights (cut as the file
    /// was read) under `plan`.
    pub fn with_plan(mut self, plan: ShardPlan) -> Transformer {
        self.tp = Some(TensorParallel {
            attention_split: plan.attention_is_split(),
            plan,
        });
        self
    }

    /// This rank's part of the model, split over `group` (see the module's
    /// doc), built block by block: each whole block is dropped once its
    /// slices are cut, so a lazily loaded model (safetensors) is never held
    /// whole. Refuses shapes that cannot be split evenly enough (a plan
    /// error names why).
    pub fn sharded(self, group: &DistGroup) -> Result<Transformer, LoadError> {
        let mlx = |e: mlx_rs::error::Exception| LoadError::Mlx(e.to_string());
        let first = self
            .blocks
            .first()
            .ok_or(LoadError::MissingConfig("layers"))?;
        let plan = ShardPlan::for_load(
            &self.config,
            group.rank(),
            group.size(),
            group_of(&first.attention.o_proj),
            group_of(&first.mlp.down_proj),
        )?;
        let split = plan.attention_is_split();
        let keep_bias = plan.keeps_row_parallel_bias();
        let Transformer {
            config,
            embed,
            blocks: whole,
            final_norm,
            lm_head,
            fresh_together,
            ..
        } = self;
        let mut blocks = Vec::with_capacity(whole.len());
        for b in whole {
            let m = &b.mlp;
            let mlp = Mlp {
                gate_proj: column_parallel(&m.gate_proj, plan.ffn.clone()).map_err(mlx)?,
                up_proj: column_parallel(&m.up_proj, plan.ffn.clone()).map_err(mlx)?,
                down_proj: row_parallel(&m.down_proj, plan.ffn.clone(), keep_bias).map_err(mlx)?,
                gate_up: None,
            };
            let attention = if split {
                let a = &b.attention;
                Attention {
                    q_proj: column_parallel(&a.q_proj, plan.q_rows()).map_err(mlx)?,
                    k_proj: column_parallel(&a.k_proj, plan.kv_rows()).map_err(mlx)?,
                    v_proj: column_parallel(&a.v_proj, plan.kv_rows()).map_err(mlx)?,
                    o_proj: row_parallel(&a.o_proj, plan.q_rows(), keep_bias).map_err(mlx)?,
                    qkv: None,
                    q_norm: a.q_norm.clone(),
                    k_norm: a.k_norm.clone(),
                }
            } else {
                b.attention
            };
            blocks.push(Block {
                attention,
                mlp,
                ..b
            });
        }
        let model = Transformer {
            config: plan.local_config(&config),
            embed,
            blocks,
            final_norm,
            lm_head,
            native: std::sync::OnceLock::new(),
            slab: std::sync::Mutex::new(None),
            tp: None,
            fresh_together,
        };
        Ok(model.with_plan(plan))
    }
}
