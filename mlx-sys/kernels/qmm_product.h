// The quantized matmul's one product `y = x @ W^T` as every loop takes it
// (`Product`), and the group sizes the kernels take.
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_PRODUCT_H
#define MLXGATE_QMM_PRODUCT_H

namespace {

/// One product `y[M, N] = x[M, K] @ W^T`, W affine-quantized by rows.
struct Product {
  const float* x;
  const uint8_t* w;  // N rows of K * bits / 8 bytes
  const void* scales;  // [N, K / group_size], f32 (or f16 when `f16`)
  const void* biases;  // likewise, or null: each bias is -bias_offset * scale
  float* y;
  int64_t m, n, k;
  int group_size, bits;  // group_size: a multiple of 32, or 16 at 8 bits
  bool f16;  // scales and biases stored as f16 (exact copies; fewer bytes)
  float bias_offset;
  bool split;  // 4 bits: per 32 weights, byte l holds weights l and l + 16
};

/// Group sizes the kernels take: multiples of 32, and 16 (Q6_K's scale
/// blocks) with 8-bit codes.
bool takes_group_size(int group_size, int bits) {
  return (group_size > 0 && group_size % 32 == 0) || (group_size == 16 && bits == 8);
}

/// Whether MLX's own quantized kernels take this group size.
bool mlx_takes_group_size(int group_size) {
  return group_size == 32 || group_size == 64 || group_size == 128;
}

/// Rows of `k` weights in such groups; rows are always whole 32-weight chunks.
bool takes_groups(int group_size, int bits, int64_t k) {
  return takes_group_size(group_size, bits) && k % group_size == 0 && k % 32 == 0;
}

}  // namespace

#endif  // MLXGATE_QMM_PRODUCT_H
