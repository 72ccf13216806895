/* mlxgate's own CPU kernels, exposed to Rust as a small C ABI.
 *
 * The quantized matmul runs as an MLX primitive, so it stays inside MLX's
 * lazy graph and is scheduled on MLX's CPU stream like its own ops; the raw
 * forms below serve the native decode step, which runs outside the graph. */
#ifndef MLXGATE_KERNELS_H
#define MLXGATE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "mlx/c/array.h"
#include "mlx/c/distributed_group.h"
#include "mlx/c/stream.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this CPU runs the kernels (x86-64 with AVX2, FMA and F16C), else 0. */
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
 * group_size a multiple of 32, or 16 at 8 bits (Q6_K's scale blocks, which
 * MLX's own kernels lack); K a multiple of 32. Returns 0, or 1 with a message
 * in `error`. */
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

/* One of several products of the same input: `y` [m, n] = x @ W^T.
 * Storage: `bits` 4 or 8 as in MLX; or, 4 bits with `split` 1: 16 bytes per
 * 32 weights, byte l holding weight l (low nibble) and weight l + 16 (high
 * nibble), which unpacks in fewer instructions. Scales are f32, or f16 when
 * `scales_f16` is 1; biases likewise, or null when every bias is
 * `-bias_offset * scale` (computed in f32); 8-bit codes without biases are
 * signed, `q - bias_offset`, and each weight is `scale * code`.
 * `bits` 5 (only where `mlxgate_kernels_five_bit_takes`): signed codes in
 * [-16, 15], no biases, groups of 32, each weight `scale * code`; per row,
 * each 96 weights in 64 bytes whose 32-bit lane i holds `code + 16` of
 * weight 16j + i at bits 5j (j = 0..5), then a last 32 weights as 16 u16
 * lanes (two codes each) or a last 64 as 16 u32 lanes (four codes each). */
typedef struct mlxgate_quantized_product {
  float* y;
  const void* w;
  const void* scales;
  const void* biases;
  int64_t n;
  int group_size;
  int bits;
  int scales_f16;
  float bias_offset;
  int split;
} mlxgate_quantized_product;

/* 1 when products with `bits` 5 of rows of `k` weights in groups of
 * `group_size` run here (AVX-512, groups of 32, k up to 32,768), else 0. */
int mlxgate_kernels_five_bit_takes(int64_t k, int group_size);
/* Products of one input `x` [m, k] on raw, packed buffers (each `w` (bits 4, 8)
 * [n, k * bits / 8] bytes, `scales`/`biases` [n, k / group_size]), run now on
 * the calling thread and the kernel pool as one job: for the native decode
 * step, which runs outside MLX's graph. Several at once (a layer's q, k and
 * v; its gate and up) cost one hand-off to the workers instead of one each.
 * Returns 0, or 1 when an operand is refused (then nothing was computed). */
int mlxgate_quantized_matmul_raw_many(
    const float* x,
    int64_t m,
    int64_t k,
    const mlxgate_quantized_product* products,
    int count);

/* Evaluates `a` if needed and, when its data is packed row-major (no view,
 * no broadcast), stores its data pointer in `data` and returns 0; else 1. */
int mlxgate_array_packed_data(const mlx_array a, const void** data);


/* One sequence's part of a batched decode attention: one query position
 * attending over `positions` cached positions, per query head h (reading kv
 * head g = h / (heads / kv_heads)):
 *   out[h] = softmax(scale * q[h] . K[g]^T) V[g]
 * `q` and `out` are [heads, head_dim]; kv head g's keys start at
 * `keys + g * head_stride`, one position every head_dim floats (likewise
 * `values`). */
typedef struct {
  float* out;
  const float* q;
  const float* keys;
  const float* values;
  int64_t head_stride;
  int64_t positions;
} mlxgate_attention_row;

/* Decode attention for `count` sequences of one layer at once, as one job
 * for the kernel pool (every sequence's heads side by side). Returns 0, or 1
 * when the operands are refused. */
int mlxgate_decode_attention_many(
    const mlxgate_attention_row* rows,
    int64_t count,
    int heads,
    int kv_heads,
    int head_dim,
    float scale);

/* Causal attention of `q` [1, heads, queries, head_dim] over `k` and `v`
 * [1, kv_heads, keys, head_dim] (float32, head_dim a multiple of 8), as an
 * MLX primitive on CPU stream `s`: query i sits at key index
 * `first_query + i` and sees keys j <= first_query + i (and, when `window`
 * > 0, j > first_query + i - window). `res` gets [1, queries, heads,
 * head_dim]. Returns 0, or 1 with a message in `error`. */
int mlxgate_causal_attention(
    mlx_array* res,
    const mlx_array q,
    const mlx_array k,
    const mlx_array v,
    float scale,
    int64_t first_query,
    int64_t window,
    const mlx_stream s,
    char* error,
    size_t error_len);

/* `silu(gate) * up` element-wise (float32, one shape; SwiGLU's gated
 * activation), as an MLX primitive on CPU stream `s`. Returns 0, or 1 with a
 * message in `error`. */
int mlxgate_silu_multiply(
    mlx_array* res,
    const mlx_array gate,
    const mlx_array up,
    const mlx_stream s,
    char* error,
    size_t error_len);

/* 1 where `mlxgate_dense` runs (an AVX-512 x86-64 CPU), else 0. */
int mlxgate_dense_supported(void);

/* `x W^T + b` in float32: x `[M, K]`, W packed as `panels` `[N / 32, K, 32]`
 * (panel p, row k holds W[32p .. 32p + 32, k]), b `[N]`; an MLX primitive on
 * CPU stream `s`. Returns 0, or 1 with a message in `error`. */
int mlxgate_dense(
    mlx_array* res,
    const mlx_array x,
    const mlx_array panels,
    const mlx_array bias,
    const mlx_stream s,
    char* error,
    size_t error_len);

/* 1 where `mlxgate_encoder_attention` runs for heads `head_dim` wide (an
 * AVX-512 x86-64 CPU; 16, 32 or 64), else 0. */
int mlxgate_encoder_attention_supported(int head_dim);

/* Bidirectional attention of packed inputs: `qkv` float32 `[tokens, 3 *
 * heads * head_dim]` (queries, keys, values side by side), input i being the
 * next `lengths[i]` tokens; each input attends over its own tokens. Returns
 * `[tokens, heads * head_dim]` (an MLX primitive on CPU stream `s`); 0, or 1
 * with a message in `error`. */
int mlxgate_encoder_attention(
    mlx_array* res,
    const mlx_array qkv,
    const int64_t* lengths,
    int64_t count,
    int heads,
    float scale,
    const mlx_stream s,
    char* error,
    size_t error_len);

/* Exact (erf) GELU element-wise on a float32 array, as an MLX primitive on
 * CPU stream `s` (erf within 1.5e-7). Returns 0, or 1 with a message in
 * `error`. */
int mlxgate_gelu(
    mlx_array* res,
    const mlx_array x,
    const mlx_stream s,
    char* error,
    size_t error_len);

/* MLX's distributed init (`backend`: "ring", "nccl", "mpi", "jaccl" or
 * "any"; NULL = "any"), storing the group in `res` (start it with
 * mlx_distributed_group_new(), free it with mlx_distributed_group_free()).
 * Returns 0, or 1 with the exception's text in `error` (mlx-c reports it
 * only to its error handler). MLX caches the group per backend name: a
 * later call returns the same group. */
int mlxgate_distributed_init(
    const char* backend,
    bool strict,
    mlx_distributed_group* res,
    char* error,
    size_t error_len);

/* Forgets every cached distributed group (MLX's clear_backends), so that a
 * group whose peer was lost can be formed again in this process: the old
 * group is destroyed (sockets closed, threads joined) once the last handle
 * to it is freed. Call only when no collective is running. */
void mlxgate_distributed_reset(void);

/* One decode step's attention over a GPU batch's key/value slab, each row
 * reading its own columns `starts[row] ..= end[0]` (a CUDA kernel MLX
 * compiles at first use; GPU streams only): `q` [rows, heads * D],
 * `k` and `v` [rows, kv_heads, columns, D], `starts` int32 [rows], `end`
 * int32 [1], `scale` float32 [1]; the result is q's shape and dtype.
 * With `k_new` and `v_new` ([rows, kv_heads, 1, D]; null `ctx`: none),
 * the kernel first writes them into column `end` of `k` and `v` in place.
 * Returns 0, or 1 with a message in `error`. */
int mlxgate_ragged_decode_attention(
    mlx_array* res,
    const mlx_array q,
    const mlx_array k,
    const mlx_array v,
    const mlx_array starts,
    const mlx_array end,
    const mlx_array scale,
    const mlx_array k_new,
    const mlx_array v_new,
    int heads,
    const mlx_stream s,
    char* error,
    size_t error_len);

/* `x @ w^T` for a decode step's 1 to 8 rows against a dense weight (a CUDA
 * kernel MLX compiles at first use; GPU streams only): `x` [..., K] and `w`
 * [N, K], both bfloat16 or float16, K a multiple of 8; the result is
 * [..., N]. With `gated`, `w` is an MLP's gate and up stacked ([2N, K])
 * and the result `silu(x @ gate^T) * (x @ up^T)`. Returns 0, or 1 with a
 * message in `error`. */
int mlxgate_decode_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    int gated,
    const mlx_stream s,
    char* error,
    size_t error_len);

/* Writes the unevaluated graph behind `outputs` to the file `path` in
 * Graphviz dot (MLX's export_to_dot). Returns 0, or 1 on any failure. */
int mlxgate_export_to_dot(const mlx_array* outputs, size_t count, const char* path);

#ifdef __cplusplus
}
#endif

#endif
