//! `mlxgate doctor`: the facts a bug report needs, as plain text.

use std::fmt::Write;
use std::path::Path;
use std::time::Instant;

use super::model::ModelSummary;
use crate::mlx::RuntimeInfo;
use crate::mlx::kernels::KernelChoice;

/// Describes the MLX runtime and tries to load `model`. Never fails: problems
/// are part of the report.
pub fn doctor_report(model: &Path) -> String {
    let info = RuntimeInfo::detect();
    let mut out = String::new();
    let _ = writeln!(out, "mlxgate {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(out, "MLX version:    {}", info.version);
    let _ = writeln!(out, "MLX backend:    {}", info.backend);
    let _ = writeln!(
        out,
        "devices:        cpu x{}, gpu x{}",
        info.cpu_devices, info.gpu_devices
    );
    if info.backend == crate::mlx::Backend::Cuda {
        match crate::mlx::CudaDevice::first() {
            Some(gpu) => {
                let _ = writeln!(
                    out,
                    "GPU:            {}, {:.1} GiB, driver supports CUDA {}",
                    gpu.name,
                    gpu.memory_bytes as f64 / (1u64 << 30) as f64,
                    gpu.driver_cuda
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "GPU:            the NVIDIA driver (libcuda.so.1) did not answer"
                );
            }
        }
        let _ = writeln!(
            out,
            "buffer cache:   {} MB of freed GPU buffers kept for reuse (MLXGATE_MLX_CACHE_MB)",
            crate::mlx::gpu_buffer_cache_mb()
        );
        let attention = match crate::mlx::attention::cudnn_min_queries() {
            Some(usize::MAX) => "MLX's kernels, unfused (MLXGATE_CUDNN_MIN_QUERIES=0; MLX_CUDA_USE_CUDNN_SDPA=0 lets MLX fuse them)".to_owned(),
            Some(min) => format!(
                "cuDNN for causal prompts of {min}+ tokens (padded to {}-token shapes), MLX's kernels for the rest (MLXGATE_CUDNN_MIN_QUERIES; MLX_CUDA_USE_CUDNN_SDPA=0: never cuDNN)",
                crate::mlx::attention::CUDNN_STEP
            ),
            None => "MLX's kernels only (MLX_CUDA_USE_CUDNN_SDPA=0)".to_owned(),
        };
        let _ = writeln!(out, "attention:      {attention}");
        let rows = crate::mlx::kernels::decode_matmul_rows();
        let matmul = if rows == 0 {
            "MLX's kernels (MLXGATE_DECODE_MATMUL_ROWS=0)".to_owned()
        } else {
            format!(
                "mlxgate's kernel for steps of up to {rows} row(s) of bfloat16/float16 against dense weights, MLX's for the rest (MLXGATE_DECODE_MATMUL_ROWS, 0-8)"
            )
        };
        let _ = writeln!(out, "dense matmul:   {matmul}");
    }
    let _ = writeln!(
        out,
        "compute dtype:  {} (MLXGATE_DTYPE=float32|bfloat16|float16 on a GPU; float32 on the CPU)",
        crate::engine::prompt_cache::tensors::dtype_name(super::model::compute_dtype())
    );
    let _ = writeln!(
        out,
        "kernels:        {} quantized matmul (MLXGATE_KERNELS=mlx|native; native needs AVX2/FMA and the CPU backend)",
        KernelChoice::default_for_process().label()
    );
    let backends: Vec<&str> = ["ring", "nccl", "mpi"]
        .into_iter()
        .filter(|b| crate::mlx::distributed::DistGroup::is_available(b))
        .collect();
    let _ = writeln!(
        out,
        "distributed:    {} (`mlxgate generate --help`: one model over several processes)",
        if backends.is_empty() {
            "no MLX backend".to_owned()
        } else {
            format!("MLX backends {}", backends.join(", "))
        }
    );
    let library = info.library.as_deref().map(|p| p.display().to_string());
    let _ = writeln!(
        out,
        "MLX library:    {}",
        library
            .as_deref()
            .unwrap_or("(not found in /proc/self/maps)")
    );
    let _ = writeln!(out, "default model:  {}", model.display());
    let started = Instant::now();
    match ModelSummary::load(model) {
        Ok(summary) => {
            let _ = writeln!(
                out,
                "model loads:    yes, in {:.2} s (id {}, arch {}, {} tensors, {} quantized, {:.1} MB)",
                started.elapsed().as_secs_f64(),
                summary.id,
                summary.architecture,
                summary.tensor_count,
                summary.quantized_count,
                summary.bytes as f64 / 1e6
            );
        }
        Err(error) => {
            let _ = writeln!(out, "model loads:    NO: {error}");
        }
    }
    out
}
