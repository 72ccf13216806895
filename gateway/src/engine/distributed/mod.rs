//! One model split over several processes with MLX's own distributed layer
//! (`mx.distributed`; the ring backend over TCP on CPUs): tensor
//! parallelism in mlx-lm's layout. q/k/v and gate/up keep a slice of their
//! output rows on each rank, o and down a slice of their input columns, and
//! an all-sum after each of the latter gives every rank the same hidden
//! state ([`plan`] says which slice is whose; [`shard`] cuts them).
//!
//! A process joins its group ([`join`], from MLX's `MLX_RANK` and
//! `MLX_HOSTFILE`, as `mlx.launch` sets them); every model it loads after
//! that is sharded over the group. Either every rank runs the same requests
//! the same way (`mlxgate generate` on each rank), so that their
//! collectives line up by themselves, or rank 0 serves HTTP and tells the
//! others, `mlxgate worker`s, each step it takes ([`lockstep`]).

pub mod lockstep;
pub mod plan;
pub mod sever;
pub mod shard;

use std::sync::{Arc, RwLock};

use crate::mlx::distributed::{self, DistGroup};

/// The group this process is in; replaced when rank 0 forms it again after
/// losing a worker ([`rejoin`]).
static GROUP: RwLock<Option<Arc<DistGroup>>> = RwLock::new(None);

/// Forms (or returns) this process's group on `backend` ("ring" on CPUs):
/// blocks until every rank has connected. Later model loads shard over it.
pub fn join(backend: &str) -> Result<Arc<DistGroup>, mlx_rs::error::Exception> {
    let mut slot = GROUP.write().unwrap_or_else(|e| e.into_inner());
    if let Some(group) = &*slot {
        return Ok(Arc::clone(group));
    }
    let group = Arc::new(DistGroup::init(backend)?);
    *slot = Some(Arc::clone(&group));
    Ok(group)
}

/// Forms the group anew after a peer was lost: drops the old one, resets
/// MLX's backends and blocks until every rank has connected again. Only
/// while no collective runs.
pub fn rejoin(backend: &str) -> Result<Arc<DistGroup>, mlx_rs::error::Exception> {
    let mut slot = GROUP.write().unwrap_or_else(|e| e.into_inner());
    slot.take();
    distributed::reset_backends();
    let group = Arc::new(DistGroup::init(backend)?);
    *slot = Some(Arc::clone(&group));
    Ok(group)
}

/// The group this process joined, if any (a group of one is no group).
pub fn group() -> Option<Arc<DistGroup>> {
    GROUP
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .filter(|g| g.size() > 1)
        .cloned()
}
