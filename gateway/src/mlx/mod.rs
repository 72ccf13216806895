//! MLX runtime facts and our native kernels under MLX.
//!
//! Everything here is blocking (MLX calls hold the thread): async callers use
//! `tokio::task::spawn_blocking`.

pub mod attention;
pub mod compiled;
pub mod distributed;
pub mod graph;
pub mod kernels;
mod runtime;

pub use runtime::{
    Backend, CUDA_ENV_DEFAULTS, CudaDevice, RuntimeInfo, gpu_buffer_cache_mb,
    limit_gpu_buffer_cache, set_process_defaults, trim_gpu_buffer_cache,
};
