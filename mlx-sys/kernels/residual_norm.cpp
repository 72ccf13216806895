// `sum = x + delta` and `rms_norm(sum) * weight` in one CUDA kernel MLX
// compiles at first use (`mlx::core::fast::cuda_kernel`): a layer's
// residual add and the norm after it.
//
// Why: a GPU decode step of one sequence is bound by launches as much as by
// bytes (the host encodes every kernel, ~600 a step for an 8B model, while
// its weights take ~3 ms to read on an H200). Each layer adds twice, each
// add followed by a norm; fused, a layer launches two kernels fewer.
//
// Rounding follows the separate ops: the sum is rounded to T (as the add
// writes it) and normed from there as MLX's RMS norm does (float32
// accumulation, `weight * T(x * normalizer)`), so only the order of the
// float32 sum of squares differs. One block of THREADS per row of H values;
// EPS_BITS is epsilon's float32 bits (a template constant, so no array is
// made per call).

#include <bit>
#include <cstdint>
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

// The body; scripts/gpu/check_kernels.sh runs it on the CPU, in CI.
const char* kResidualNormSource = R"residual_norm(
  constexpr int THREADS = 256;
  const float eps = __int_as_float(EPS_BITS);
  const int t = threadIdx.x;
  const size_t row = blockIdx.x;
  const T* xr = x + row * H;
  const T* dr = delta + row * H;
  T* sr = sum + row * H;
  T* nr = normed + row * H;
  float squares = 0.0f;
  for (int i = t; i < H; i += THREADS) {
    const T s = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
    sr[i] = s;
    const float f = static_cast<float>(s);
    squares += f * f;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    squares += __shfl_xor_sync(0xffffffff, squares, offset);
  }
  __shared__ float partial[THREADS / 32];
  if (t % 32 == 0) {
    partial[t / 32] = squares;
  }
  __syncthreads();
  float total = 0.0f;
  for (int warp = 0; warp < THREADS / 32; warp++) {
    total += partial[warp];
  }
  const float normalizer = rsqrtf(total / H + eps);
  // Each thread reads back only the values it wrote.
  for (int i = t; i < H; i += THREADS) {
    const T y = static_cast<T>(static_cast<float>(sr[i]) * normalizer);
    nr[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(y));
  }
)residual_norm";

}  // namespace

extern "C" int mlxgate_residual_norm(
    mlx_array* sum,
    mlx_array* normed,
    const mlx_array x,
    const mlx_array delta,
    const mlx_array weight,
    float eps,
    const mlx_stream s,
    char* error,
    size_t error_len) {
  try {
    const mx::array& xa = mlx_array_get_(x);
    const mx::array& da = mlx_array_get_(delta);
    const mx::array& wa = mlx_array_get_(weight);
    if (xa.ndim() < 1 || xa.shape() != da.shape() || wa.ndim() != 1 ||
        wa.shape(0) != xa.shape(-1) || xa.dtype() != da.dtype() || xa.dtype() != wa.dtype() ||
        (xa.dtype() != mx::bfloat16 && xa.dtype() != mx::float16)) {
      throw std::invalid_argument(
          "[mlxgate residual norm] x and delta must be [..., H] and weight [H], all bfloat16 or "
          "float16");
    }
    const mx::StreamOrDevice stream = mlx_stream_get_(s);
    if (xa.is_tracer() || da.is_tracer() || wa.is_tracer()) {
      // Traced for a gradient: MLX's ops, which have one (a custom kernel
      // has none).
      mx::array total = mx::add(xa, da, stream);
      mlx_array_set_(*normed, mx::fast::rms_norm(total, wa, eps, stream));
      mlx_array_set_(*sum, total);
      return 0;
    }
    static const mx::fast::CustomKernelFunction kernel = mx::fast::cuda_kernel(
        "mlxgate_residual_norm", {"x", "delta", "weight"}, {"sum", "normed"},
        kResidualNormSource, "", /*ensure_row_contiguous=*/true);
    const int h = xa.shape(-1);
    const int rows = xa.size() / h;
    auto outputs = kernel(
        {xa, da, wa}, {xa.shape(), xa.shape()}, {xa.dtype(), xa.dtype()}, {256 * rows, 1, 1},
        {256, 1, 1},
        {{"T", xa.dtype()}, {"H", h}, {"EPS_BITS", std::bit_cast<int32_t>(eps)}}, std::nullopt,
        false, stream);
    mlx_array_set_(*sum, outputs.at(0));
    mlx_array_set_(*normed, outputs.at(1));
    return 0;
  } catch (std::exception& e) {
    return mlxgate::failed(e, error, error_len);
  }
}
