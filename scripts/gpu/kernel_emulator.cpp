// Runs a ragged decode attention kernel body (CUDA, as MLX's
// `fast::cuda_kernel` takes it) on the CPU, one OS thread per CUDA thread
// (scripts/gpu/emulation.h), and checks it against attention computed
// plainly: CI has no GPU, and this keeps the kernels' logic (rows' column
// ranges, the online softmax, the warps' merge) checked there.
// scripts/gpu/check_kernels.sh builds it once per body:
//
//   g++ -std=c++20 -O1 -pthread -DBODY='"body.cu"' -DHEADER='"write_column.cu"' -DBLOCK_THREADS=128 \
//       -DPER_KV_HEAD=0 kernel_emulator.cpp
//
// BLOCK_THREADS is the block size; PER_KV_HEAD=1 launches a block per
// key/value head and row, 0 a block per query head and row. T is float.
// Each case runs twice: reading the slab as it is (WRITE 0), and writing
// the step's key and value into its last column first (WRITE 1: that
// column starts as NaN, so a row that reads it before it is written fails).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "emulation.h"

// The device function both bodies call (MLX puts it before each kernel).
#include HEADER

template <typename T, int D, int GQA, int WRITE>
static void kernel(const T* q, const T* k, const T* v, const int* starts, const int* end,
                   const float* scale, const T* k_new, const T* v_new, const int64_t* k_strides,
                   const int64_t* v_strides, T* out) {
#include BODY
}

// One case: `rows` rows over a slab of `capacity` columns ending at `last`,
// each row from its start; k and v with a row stride padded past packed, so
// that the kernel must read them by their strides.
template <int D, int GQA, int WRITE>
static double check_one(int rows, int kv_heads, int capacity, int last, const std::vector<int>& starts) {
  const int heads = kv_heads * GQA;
  std::mt19937 rng(rows * 131 + D + GQA);
  std::normal_distribution<float> normal;
  const int64_t pad = 3 * D;
  const int64_t strides[4] = {kv_heads * capacity * D + pad, capacity * D, D, 1};
  std::vector<float> q(rows * heads * D), k(rows * strides[0]), v(rows * strides[0]);
  std::vector<float> out(q.size(), NAN);
  for (auto& x : q) x = normal(rng);
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  // The step's key and value, [rows, kv_heads, D]; with WRITE, the slab's
  // last column holds NaN until the kernel writes them there.
  std::vector<float> k_new(rows * kv_heads * D), v_new(k_new.size());
  for (int row = 0; row < rows; row++) {
    for (int kv = 0; kv < kv_heads; kv++) {
      for (int i = 0; i < D; i++) {
        const int64_t at = row * strides[0] + kv * strides[1] + last * strides[2] + i;
        const int64_t from = (row * kv_heads + kv) * D + i;
        k_new[from] = WRITE ? normal(rng) : k[at];
        v_new[from] = WRITE ? normal(rng) : v[at];
        if (WRITE) k[at] = v[at] = NAN;
      }
    }
  }
  const float scale = 1.0f / std::sqrt(float(D));
  const int end = last;
  gridDim = {PER_KV_HEAD ? kv_heads : heads, rows, 1};
  launch([&] {
    kernel<float, D, GQA, WRITE>(q.data(), k.data(), v.data(), starts.data(), &end, &scale,
                                 k_new.data(), v_new.data(), strides, strides, out.data());
  });
  double worst = 0;
  // The last column now holds the step's key and value (written, or so
  // from the start).
  for (int row = 0; row < rows; row++) {
    for (int kv = 0; kv < kv_heads; kv++) {
      for (int i = 0; i < D; i++) {
        const int64_t at = row * strides[0] + kv * strides[1] + last * strides[2] + i;
        const int64_t from = (row * kv_heads + kv) * D + i;
        if (!(k[at] == k_new[from] && v[at] == v_new[from])) worst = INFINITY;
      }
    }
  }
  for (int row = 0; row < rows; row++) {
    for (int head = 0; head < heads; head++) {
      const int kv = head / GQA;
      const float* qh = &q[(row * heads + head) * D];
      std::vector<double> score;
      double top = -INFINITY;
      for (int j = starts[row]; j <= last; j++) {
        const float* kj = &k[row * strides[0] + kv * strides[1] + j * strides[2]];
        double s = 0;
        for (int i = 0; i < D; i++) s += double(qh[i]) * kj[i];
        score.push_back(s * scale);
        top = std::max(top, score.back());
      }
      double total = 0;
      for (auto& s : score) total += (s = std::exp(s - top));
      for (int i = 0; i < D; i++) {
        double want = 0;
        for (int j = starts[row]; j <= last; j++) {
          want += score[j - starts[row]] / total *
                  v[row * strides[0] + kv * strides[1] + j * strides[2] + i];
        }
        const double got = out[(row * heads + head) * D + i];
        worst = std::isnan(got) ? INFINITY : std::max(worst, std::abs(got - want));
      }
    }
  }
  return worst;
}

// Both ways: reading the slab as it is, and writing the last column first.
template <int D, int GQA>
static double check(int rows, int kv_heads, int capacity, int last, const std::vector<int>& starts) {
  return std::max(check_one<D, GQA, 0>(rows, kv_heads, capacity, last, starts),
                  check_one<D, GQA, 1>(rows, kv_heads, capacity, last, starts));
}

int main() {
  // Rows of many columns, of a few, and of one (a hole attends its last).
  const double a = check<64, 3>(3, 2, 48, 40, {0, 29, 40});
  const double b = check<128, 4>(2, 2, 24, 17, {5, 0});
  const double c = check<32, 1>(2, 3, 12, 9, {9, 2});
  // Gemma 3 270M's heads (256 wide, 4 to a key/value head), Qwen2.5-0.5B's (64, 7).
  const double d = check<256, 4>(2, 1, 20, 15, {0, 12});
  const double e = check<64, 7>(2, 2, 16, 11, {3, 0});
  std::printf("max |kernel - reference|: %.3g (D 64, GQA 3), %.3g (D 128, GQA 4), %.3g (D 32, GQA 1), "
              "%.3g (D 256, GQA 4), %.3g (D 64, GQA 7)\n", a, b, c, d, e);
  return a < 1e-4 && b < 1e-4 && c < 1e-4 && d < 1e-4 && e < 1e-4 ? 0 : 1;
}
