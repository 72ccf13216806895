//! One model split over several processes with MLX's own distributed layer
//! (`mx.distributed`; the ring backend over TCP on CPUs): tensor
//! parallelism in mlx-lm's layout. q/k/v and gate/up keep a slice of their
//! output rows on each rank, o and down a slice of their input columns, and
//! an all-sum after each of the latter gives every rank the same hidden
//! state ([`plan`] says which slice is whose; [`shard`] cuts them).
//!
//! A process joins its group once ([`join`], from MLX's `MLX_RANK` and
//! `MLX_HOSTFILE`, as `mlx.launch` sets them); every model it loads after
//! that is sharded over the group. Every rank runs the same requests the
//! same way (`mlxgate generate` on each rank), so their collectives line up
//! without further coordination; serving HTTP from rank 0 with the others
//! as workers is the next step (see the README).

pub mod plan;
pub mod shard;

use std::sync::{Arc, OnceLock};

use crate::mlx::distributed::DistGroup;

static GROUP: OnceLock<Arc<DistGroup>> = OnceLock::new();

/// Forms (or returns) this process's group on `backend` ("ring" on CPUs):
/// blocks until every rank has connected. Later model loads shard over it.
pub fn join(backend: &str) -> Result<Arc<DistGroup>, mlx_rs::error::Exception> {
    if let Some(group) = GROUP.get() {
        return Ok(Arc::clone(group));
    }
    let group = Arc::new(DistGroup::init(backend)?);
    Ok(Arc::clone(GROUP.get_or_init(|| group)))
}

/// The group this process joined, if any (a group of one is no group).
pub fn group() -> Option<Arc<DistGroup>> {
    GROUP.get().filter(|g| g.size() > 1).cloned()
}
