// Runs the decode matmul kernel body (mlx-sys/kernels/decode_matmul.cpp)
// on the CPU (scripts/gpu/emulation.h) and checks it against `x @ w^T`
// computed plainly, for shapes that leave a partial last chunk of K and a
// partial last block of rows; GATED against `silu(x @ gate^T) * (x @ up^T)`. scripts/gpu/check_kernels.sh builds it:
//
//   g++ -std=c++20 -O1 -pthread -DBODY='"body.cu"' -DBLOCK_THREADS=256 decode_matmul_emulator.cpp
//
// T is float, so a 16-byte chunk holds 4 values instead of 8.

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "emulation.h"

template <typename T, int M, int K, int N, int ROWS, int GATED>
static void kernel(const T* x, const T* w, T* out) {
#include BODY
}

template <int M, int K, int N, int ROWS, int GATED = 0>
static double check() {
  std::mt19937 rng(M * 131 + K + N + GATED);
  std::normal_distribution<float> normal;
  // 16-byte aligned, as MLX's buffers are. Gated: gate's N rows, then up's.
  const int weight_rows = GATED ? 2 * N : N;
  std::vector<float, std::allocator<float>> x(M * K), w(weight_rows * K), out(M * N, NAN);
  for (auto& v : x) v = normal(rng);
  for (auto& v : w) v = normal(rng);
  gridDim = {(N + ROWS - 1) / ROWS, 1, 1};
  launch([&] { kernel<float, M, K, N, ROWS, GATED>(x.data(), w.data(), out.data()); });
  const auto dot = [&](int m, int n) {
    double sum = 0;
    for (int k = 0; k < K; k++) sum += double(x[m * K + k]) * w[n * K + k];
    return sum;
  };
  double worst = 0;
  for (int m = 0; m < M; m++) {
    for (int n = 0; n < N; n++) {
      double want = dot(m, n);
      if (GATED) want = want / (1 + std::exp(-want)) * dot(m, N + n);
      const double got = out[m * N + n];
      // Relative beyond 1: a gated product reaches the hundreds.
      worst = std::isnan(got) ? INFINITY : std::max(worst, std::abs(got - want) / (1 + std::abs(want)));
    }
  }
  return worst;
}

int main() {
  // One row, K under one pass of the block; three rows, K over two passes
  // with a partial second one; eight rows. N not a multiple of ROWS.
  const double a = check<1, 64, 10, 4>();
  const double b = check<3, 1024 + 96, 7, 4>();
  const double c = check<8, 512, 9, 2>();
  // Gated: one row, then four over a partial last block.
  const double d = check<1, 256, 12, 4, 1>();
  const double e = check<4, 1024 + 96, 7, 4, 1>();
  std::printf("max |kernel - reference| / (1 + |reference|): %.3g (M 1, K 64, N 10), %.3g (M 3, K 1120, N 7), "
              "%.3g (M 8, K 512, N 9); gated %.3g (M 1, K 256, N 12), %.3g (M 4, K 1120, N 7)\n",
              a, b, c, d, e);
  return a < 1e-3 && b < 1e-3 && c < 1e-3 && d < 1e-3 && e < 1e-3 ? 0 : 1;
}
