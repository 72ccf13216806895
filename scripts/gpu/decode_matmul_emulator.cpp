// Runs the decode matmul kernel body (mlx-sys/kernels/decode_matmul.cpp)
// on the CPU (scripts/gpu/emulation.h) and checks it against `x @ w^T`
// computed plainly, for shapes that leave a partial last chunk of K and a
// partial last block of rows. scripts/gpu/check_kernels.sh builds it:
//
//   g++ -std=c++20 -O1 -pthread -DBODY='"body.cu"' -DBLOCK_THREADS=256 decode_matmul_emulator.cpp
//
// T is float, so a 16-byte chunk holds 4 values instead of 8.

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "emulation.h"

template <typename T, int M, int K, int N, int ROWS>
static void kernel(const T* x, const T* w, T* out) {
#include BODY
}

template <int M, int K, int N, int ROWS>
static double check() {
  std::mt19937 rng(M * 131 + K + N);
  std::normal_distribution<float> normal;
  // 16-byte aligned, as MLX's buffers are.
  std::vector<float, std::allocator<float>> x(M * K), w(N * K), out(M * N, NAN);
  for (auto& v : x) v = normal(rng);
  for (auto& v : w) v = normal(rng);
  gridDim = {(N + ROWS - 1) / ROWS, 1, 1};
  launch([&] { kernel<float, M, K, N, ROWS>(x.data(), w.data(), out.data()); });
  double worst = 0;
  for (int m = 0; m < M; m++) {
    for (int n = 0; n < N; n++) {
      double want = 0;
      for (int k = 0; k < K; k++) want += double(x[m * K + k]) * w[n * K + k];
      const double got = out[m * N + n];
      worst = std::isnan(got) ? INFINITY : std::max(worst, std::abs(got - want));
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
  std::printf("max |kernel - reference|: %.3g (M 1, K 64, N 10), %.3g (M 3, K 1120, N 7), "
              "%.3g (M 8, K 512, N 9)\n", a, b, c);
  return a < 1e-3 && b < 1e-3 && c < 1e-3 ? 0 : 1;
}
