// `x @ w^T` for the few rows of a decode step against a dense bfloat16 or
// float16 weight, as a CUDA kernel MLX compiles at first use
// (`mlx::core::fast::cuda_kernel`).
//
// Why: a decode step of a few sequences reads every weight once, so its
// speed is the memory bandwidth its matmuls reach. MLX runs one row through
// its own `gemv` and 2-8 rows through cuBLAS, which reaches much less of
// the bandwidth there: on an H100, 8B shapes, a step's matmuls took 8.1 /
// 9.2 ms at 2 / 4 rows against 5.8 / 5.7 with this kernel (the same 5.1 at
// 1 row, and 7.6 at 8; scripts/gpu/matmul_probe.py). Each block computes
// ROWS outputs for every row of x, its 256 threads loading 16 bytes of
// each of the ROWS weight rows at once, so each thread keeps ROWS loads in
// flight.
//
// Layout: x [M, K] and w [N, K], both packed; out [M, N]. K a multiple of
// 16 bytes' worth of T; M, K, N and ROWS are template constants (a model
// has a few weight shapes, each compiled once per row count). Inputs traced
// for a gradient take MLX's matmul instead.
//
// GATED = 1 is the MLP's first half in one launch: w is gate and up stacked
// ([2N, K], gate's rows first) and out is `silu(x @ gate^T) * (x @ up^T)`,
// each block reading its ROWS rows of both. A decode step is as much
// launches as bytes on a GPU (the host encodes each one): this saves the
// second matmul's and the activation's, two a layer.

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "primitive_support.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlxgate_kernels.h"

namespace mx = mlx::core;

namespace {

// The body; MLX writes its signature from the names below.
// scripts/gpu/matmul_probe.py (on a GPU) and scripts/gpu/check_kernels.sh
// (emulated on the CPU, in CI) read it from here, between the markers.
const char* kDecodeMatmulSource = R"decode_matmul(
  constexpr int THREADS = 256;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int STEP = THREADS * VEC;
  struct alignas(16) Chunk {
    T v[VEC];
  };
  // Weight rows a block reads: its ROWS outputs' (gate's and up's if GATED).
  constexpr int LOADS = GATED ? 2 * ROWS : ROWS;
  const int t = threadIdx.x;
  const int first = blockIdx.x * ROWS;
  float acc[M][LOADS];
#pragma unroll
  for (int m = 0; m < M; m++) {
#pragma unroll
    for (int r = 0; r < LOADS; r++) {
      acc[m][r] = 0.0f;
    }
  }
#pragma unroll
  for (int k0 = t * VEC; k0 < K; k0 += STEP) {
    // Every weight row's chunk first: LOADS loads in flight at once. A
    // block past the last row re-reads it and drops the result.
    Chunk wc[LOADS];
#pragma unroll
    for (int r = 0; r < LOADS; r++) {
      const int output = first + r % ROWS;
      const int n = (output < N ? output : N - 1) + (r < ROWS ? 0 : N);
      wc[r] = *reinterpret_cast<const Chunk*>(w + (size_t)n * K + k0);
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
      const Chunk xc = *reinterpret_cast<const Chunk*>(x + (size_t)m * K + k0);
#pragma unroll
      for (int r = 0; r < LOADS; r++) {
#pragma unroll
        for (int i = 0; i < VEC; i++) {
          acc[m][r] += static_cast<float>(wc[r].v[i]) * static_cast<float>(xc.v[i]);
        }
      }
    }
  }
  __shared__ float partial[THREADS / 32][M * LOADS];
#pragma unroll
  for (int m = 0; m < M; m++) {
#pragma unroll
    for (int r = 0; r < LOADS; r++) {
      float s = acc[m][r];
      for (int offset = 16; offset > 0; offset /= 2) {
        s += __shfl_xor_sync(0xffffffff, s, offset);
      }
      if (t % 32 == 0) {
        partial[t / 32][m * LOADS + r] = s;
      }
    }
  }
  __syncthreads();
  if (t < M * ROWS) {
    const int m = t / ROWS;
    const int r = t % ROWS;
    const int n = first + r;
    if (n < N) {
      float s = 0.0f;
      float u = 0.0f;
      for (int warp = 0; warp < THREADS / 32; warp++) {
        s += partial[warp][m * LOADS + r];
        if (GATED) {
          u += partial[warp][m * LOADS + ROWS + r];
        }
      }
      if (GATED) {
        // Gate and up rounded as the separate matmuls round them, the
        // activation then rounded once (the separate ops may round inside
        // it too: within one rounding of them).
        const float gate = static_cast<float>(static_cast<T>(s));
        const float up = static_cast<float>(static_cast<T>(u));
        s = gate / (1.0f + expf(-gate)) * up;
      }
      out[(size_t)m * N + n] = static_cast<T>(s);
    }
  }
)decode_matmul";

// Weight rows per block: 4 loads of 16 bytes in flight per thread.
constexpr int kRowsPerBlock = 4;

}  // namespace

extern "C" int mlxgate_decode_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    int gated,
    const mlx_stream s,
    char* error,
    size_t error_len) {
  try {
    const mx::array& xa = mlx_array_get_(x);
    const mx::array& wa = mlx_array_get_(w);
    const mx::StreamOrDevice stream = mlx_stream_get_(s);
    if (xa.ndim() < 1 || wa.ndim() != 2 || xa.shape(-1) != wa.shape(1) ||
        xa.dtype() != wa.dtype() ||
        (xa.dtype() != mx::bfloat16 && xa.dtype() != mx::float16)) {
      throw std::invalid_argument(
          "[mlxgate decode matmul] x must be [..., K] and w [N, K], both bfloat16 or float16");
    }
    const int k = wa.shape(1);
    const int n = gated ? wa.shape(0) / 2 : wa.shape(0);
    const int m = xa.size() / k;
    if (k % 8 != 0 || m < 1 || m > 8 || (gated && wa.shape(0) % 2 != 0)) {
      throw std::invalid_argument(
          "[mlxgate decode matmul] K must be a multiple of 8, x hold 1 to 8 rows, and a gated "
          "weight's rows be even (gate's, then up's)");
    }
    if (xa.is_tracer() || wa.is_tracer()) {
      // Traced for a gradient (fine-tuning: a batch's few target rows through
      // the output head): MLX's ops, which have one; a custom kernel has
      // none. (libmlx exports no "in a gradient" query; a tracer is one.)
      mx::array y = mx::matmul(xa, mx::transpose(wa, stream), stream);
      if (gated) {
        const int last = y.ndim() - 1;
        auto halves = mx::split(y, 2, last, stream);
        y = mx::multiply(mx::multiply(halves[0], mx::sigmoid(halves[0], stream), stream),
                         halves[1], stream);
      }
      mlx_array_set_(*res, y);
      return 0;
    }
    static const mx::fast::CustomKernelFunction kernel = mx::fast::cuda_kernel(
        "mlxgate_decode_matmul", {"x", "w"}, {"out"}, kDecodeMatmulSource, "",
        /*ensure_row_contiguous=*/true);
    mx::Shape out_shape = xa.shape();
    out_shape.back() = n;
    const int blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    auto outputs = kernel({xa, wa}, {out_shape}, {xa.dtype()}, {256 * blocks, 1, 1}, {256, 1, 1},
                          {{"T", xa.dtype()}, {"M", m}, {"K", k}, {"N", n}, {"ROWS", kRowsPerBlock},
                           {"GATED", gated ? 1 : 0}},
                          std::nullopt, false, stream);
    mlx_array_set_(*res, outputs.at(0));
    return 0;
  } catch (std::exception& e) {
    return mlxgate::failed(e, error, error_len);
  }
}
