//! MLX's distributed groups and their all-sum (mx.distributed), through
//! mlx-c 0.7.0 (`mlx_distributed_*`, already in mlx-sys's bindings) and two
//! shims of ours: `mlxgate_distributed_init`, which keeps the text of MLX's
//! error (mlx-c reports it only to its error handler), and
//! `mlxgate_distributed_reset`, which lets a group be formed again.
//!
//! The ring backend reads `MLX_RANK` and `MLX_HOSTFILE` (a path to a JSON
//! list of `"ip:port"` lists, index = rank) when `init` runs. A collective
//! is a node of MLX's lazy graph; the work and any communication error
//! happen at `eval`, where mlx-rs returns the error (e.g. "[ring]
//! connection to a peer was lost"). MLX's ring has no timeout of its own,
//! and a group whose peer was lost is not to be used again: drop it,
//! [`reset_backends`] and init anew.

use std::ffi::{CStr, CString, c_char};

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

/// A communication group: this process's rank among `size` processes.
/// Dropping it frees our handle; MLX keeps the group itself for the
/// process's life.
pub struct DistGroup {
    raw: mlx_sys::mlx_distributed_group,
    rank: usize,
    size: usize,
}

// SAFETY: the handle owns a heap `mlx::core::distributed::Group` (a
// shared_ptr to the implementation); rank/size are fixed, and collectives
// are only built from the engine thread that owns the model. Moving the
// handle between threads is sound; sharing it is only done read-only.
unsafe impl Send for DistGroup {}
unsafe impl Sync for DistGroup {}

impl DistGroup {
    /// Whether MLX was built with `backend` ("ring", "nccl", "mpi", "jaccl"
    /// or "any").
    pub fn is_available(backend: &str) -> bool {
        let Ok(name) = CString::new(backend) else {
            return false;
        };
        // SAFETY: a valid NUL-terminated string for the call's duration.
        unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) }
    }

    /// Initialises `backend` strictly (an error, never a size-1 group, when
    /// the environment does not describe a group). Blocks until every peer
    /// has connected: the ring accepts without a timeout (sever this rank's
    /// listening socket to give up, see `cluster::sever`).
    pub fn init(backend: &str) -> Result<DistGroup, Exception> {
        let name = CString::new(backend).map_err(|e| Exception::custom(e.to_string()))?;
        let mut error = [0 as c_char; 512];
        // SAFETY: `raw` starts empty (NULL ctx); on success the shim stores a
        // new Group in it, which we own; on failure it stays empty or is freed.
        unsafe {
            let mut raw = mlx_sys::mlx_distributed_group_new();
            let status = mlx_sys::mlxgate_distributed_init(
                name.as_ptr(),
                true,
                &mut raw,
                error.as_mut_ptr(),
                error.len(),
            );
            if status != 0 {
                mlx_sys::mlx_distributed_group_free(raw);
                let message = CStr::from_ptr(error.as_ptr()).to_string_lossy();
                return Err(Exception::custom(format!(
                    "distributed init ({backend}): {message}"
                )));
            }
            let rank = mlx_sys::mlx_distributed_group_rank(raw);
            let size = mlx_sys::mlx_distributed_group_size(raw);
            if rank < 0 || size < 1 {
                mlx_sys::mlx_distributed_group_free(raw);
                return Err(Exception::custom(format!(
                    "distributed init ({backend}): rank {rank} of {size}"
                )));
            }
            Ok(DistGroup {
                raw,
                rank: rank as usize,
                size: size as usize,
            })
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The elementwise sum of `x` over every rank (same shape and dtype on
    /// all of them), as a lazy node on this thread's stream.
    pub fn all_sum(&self, x: &Array) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        // SAFETY: `res` starts empty and on success owns a new array, passed
        // to `Array::from_ptr`; `x`, the group and the stream outlive the call.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            let status = mlx_sys::mlx_distributed_all_sum(
                &mut res,
                x.as_ptr(),
                self.raw,
                stream.as_ref().as_ptr(),
            );
            if status == 0 {
                Ok(Array::from_ptr(res))
            } else {
                mlx_sys::mlx_array_free(res);
                // mlx-c reported the message to mlx-rs's handler, which we
                // cannot read; building the node fails only for bad shapes.
                Err(Exception::custom(format!(
                    "all_sum failed for shape {:?} {:?}",
                    x.shape(),
                    x.dtype()
                )))
            }
        }
    }
}

/// Forgets MLX's cached groups, so that the next [`DistGroup::init`] forms a
/// new one (after a peer was lost). The old group closes its sockets once
/// the last handle to it is dropped: drop ours first, and call this only
/// when no collective is running.
pub fn reset_backends() {
    // SAFETY: no arguments; the shim catches every C++ exception.
    unsafe { mlx_sys::mlxgate_distributed_reset() }
}

impl Drop for DistGroup {
    fn drop(&mut self) {
        // SAFETY: `raw` was filled by init and is freed once, here.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.raw);
        }
    }
}
