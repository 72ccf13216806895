// Runs the residual norm kernel body (mlx-sys/kernels/residual_norm.cpp) on
// the CPU (scripts/gpu/emulation.h) and checks both outputs against the add
// and RMS norm computed plainly, for rows shorter than a block and rows of
// several passes with a partial last one. scripts/gpu/check_kernels.sh
// builds it:
//
//   g++ -std=c++20 -O1 -pthread -DBODY='"body.cu"' -DBLOCK_THREADS=256 residual_norm_emulator.cpp

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "emulation.h"

template <typename T, int H, int EPS_BITS>
static void kernel(const T* x, const T* delta, const T* weight, T* sum, T* normed) {
#include BODY
}

constexpr float kEps = 1e-5f;

template <int ROWS, int H>
static double check() {
  std::mt19937 rng(ROWS * 7 + H);
  std::normal_distribution<float> normal;
  std::vector<float> x(ROWS * H), delta(ROWS * H), weight(H), sum(ROWS * H, NAN),
      normed(ROWS * H, NAN);
  for (auto& v : x) v = normal(rng);
  for (auto& v : delta) v = normal(rng);
  for (auto& v : weight) v = normal(rng);
  gridDim = {ROWS, 1, 1};
  launch([&] {
    kernel<float, H, std::bit_cast<int>(kEps)>(x.data(), delta.data(), weight.data(), sum.data(),
                                               normed.data());
  });
  double worst = 0;
  for (int r = 0; r < ROWS; r++) {
    double squares = 0;
    for (int i = 0; i < H; i++) {
      const double s = double(x[r * H + i]) + delta[r * H + i];
      squares += s * s;
    }
    const double scale = 1 / std::sqrt(squares / H + kEps);
    for (int i = 0; i < H; i++) {
      const double s = double(x[r * H + i]) + delta[r * H + i];
      const double got_sum = sum[r * H + i], got = normed[r * H + i];
      if (std::isnan(got_sum) || std::isnan(got)) return INFINITY;
      worst = std::max({worst, std::abs(got_sum - s), std::abs(got - s * scale * weight[i])});
    }
  }
  return worst;
}

int main() {
  const double a = check<1, 96>();
  const double b = check<3, 4096 + 72>();
  std::printf("max |kernel - reference|: %.3g (1 row of 96), %.3g (3 rows of 4168)\n", a, b);
  return a < 1e-4 && b < 1e-4 ? 0 : 1;
}
