// AVX2 + FMA kernels for prefill and larger batches (M > 4): rows
// dequantized in blocks and reused by many inputs through a register tile
// (`large_batch_rows`).
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_AVX2_PREFILL_H
#define MLXGATE_QMM_AVX2_PREFILL_H

#if defined(MLXGATE_X86)

namespace {

/// Dequantizes rows [n, n + rows) into `out` (rows x K floats).
template <class L>
AVX2 void dequantize_rows(const Product& p, int64_t n, int rows, float* out) {
  constexpr int BITS = L::kBits;
  const int64_t row_bytes = p.k * BITS / 8;
  const int64_t chunks = p.k / 32;
  const GroupOfChunk<L> group_of(p.group_size);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* w = p.w + (n + r) * row_bytes;
    const RowGroups<L> row_groups(p, n + r);
    float* dst = out + r * p.k;
    for (int64_t c = 0; c < chunks; ++c) {
      const ChunkGroups g = group_of(c);
      __m256 scale[2], bias[2];
      row_groups.at(g, scale, bias);
      const int64_t k = c * 32;
      __m256 q[4];
      if constexpr (L::kSigned) {
        load_signed_codes(w + k, q);
        for (int i = 0; i < 4; ++i) {
          _mm256_store_ps(dst + k + 8 * i, _mm256_mul_ps(q[i], scale[i / 2]));
        }
        continue;
      }
      load_codes<BITS, L::kSplit>(w + k * BITS / 8, q);
      for (int i = 0; i < 4; ++i) {
        _mm256_store_ps(dst + k + 8 * i, _mm256_fmadd_ps(q[i], scale[i / 2], bias[i / 2]));
      }
    }
  }
}

/// `R` dequantized rows (`w`, R x K) against `C` inputs starting at row m.
template <int R, int C>
AVX2 inline void tile(const Product& p, const float* w, int64_t n, int64_t m) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm256_setzero_ps();
    }
  }
  const float* x = p.x + m * p.k;
  for (int64_t k = 0; k < p.k; k += 8) {
    __m256 xv[C];
    for (int c = 0; c < C; ++c) {
      xv[c] = _mm256_loadu_ps(x + c * p.k + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_load_ps(w + r * p.k + k);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) {
      p.y[(m + c) * p.n + n + r] = horizontal_sum(acc[r][c]);
    }
  }
}

/// Prefill and larger batches: rows [n0, n1) in blocks of 4, each block
/// dequantized once per block of inputs that fits in L2 and reused by all of
/// them through a 4 x 3 register tile.
template <class L>
AVX2 void large_batch_rows(const Product& p, int64_t n0, int64_t n1) {
  constexpr int kRows = 4;
  constexpr int kCols = 3;
  // Inputs per block: their K floats stay in L2 (~256 KiB) while every row
  // block of this part passes over them.
  const int64_t inputs_per_block =
      std::max<int64_t>(kCols, (65536 / p.k) / kCols * kCols);
  float* rows = static_cast<float*>(
      std::aligned_alloc(32, sizeof(float) * kRows * p.k));
  for (int64_t m0 = 0; m0 < p.m; m0 += inputs_per_block) {
    const int64_t m1 = std::min(p.m, m0 + inputs_per_block);
    int64_t n = n0;
    for (; n + kRows <= n1; n += kRows) {
      dequantize_rows<L>(p, n, kRows, rows);
      int64_t m = m0;
      for (; m + kCols <= m1; m += kCols) {
        tile<kRows, kCols>(p, rows, n, m);
      }
      for (; m < m1; ++m) {
        tile<kRows, 1>(p, rows, n, m);
      }
    }
    for (; n < n1; ++n) {
      dequantize_rows<L>(p, n, 1, rows);
      for (int64_t m = m0; m < m1; ++m) {
        tile<1, 1>(p, rows, n, m);
      }
    }
  }
  std::free(rows);
}

}  // namespace

#endif  // MLXGATE_X86

#endif  // MLXGATE_QMM_AVX2_PREFILL_H
