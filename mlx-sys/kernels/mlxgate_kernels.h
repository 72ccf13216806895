/* mlxgate's own CPU kernels, exposed to Rust as a small C ABI.
 *
 * They run as MLX primitives, so they stay inside MLX's lazy graph and are
 * scheduled on MLX's CPU stream like its own ops. */
#ifndef MLXGATE_KERNELS_H
#define MLXGATE_KERNELS_H

#include <stddef.h>

#include "mlx/c/array.h"
#include "mlx/c/stream.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this CPU runs the kernels (x86-64 with AVX2 and FMA), else 0. */
int mlxgate_kernels_supported(void);

/* Threads the kernels split their work across (1 .. 64); 0 means one per core
 * this process may run on. Returns the count now in effect. */
int mlxgate_kernels_set_threads(int threads);

/* Sets OpenBLAS's thread count (MLX's f32 matmuls go through it where the
 * system has it). Returns the previous count, or -1 when OpenBLAS is absent.
 * Its idle threads spin for a long while after each call: for the many small
 * matmuls of decoding, one thread avoids stealing the cores the kernels use. */
int mlxgate_blas_set_threads(int threads);

/* `x @ W^T` for an affine-quantized W (MLX layout: `w` u32 [N, K * bits / 32],
 * `scales` and `biases` f32 [N, K / group_size]) and an f32 `x` [..., K]:
 * what `mlx_quantized_matmul(..., transpose = true, ...)` computes, with each
 * weight's true value `scale * q + bias` accumulated in f32. bits is 4 or 8,
 * group_size a multiple of 32. Returns 0, or 1 with a message in `error`. */
int mlxgate_quantized_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    const mlx_array scales,
    const mlx_array biases,
    int group_size,
    int bits,
    const mlx_stream s,
    char* error,
    size_t error_len);

#ifdef __cplusplus
}
#endif

#endif
