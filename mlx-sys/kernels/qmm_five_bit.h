// Five-bit codes (Q5_0 weights) packed 96 to a 64-byte vector, and their
// AVX-512 loops for every batch size (`five_bit_rows`).
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_FIVE_BIT_H
#define MLXGATE_QMM_FIVE_BIT_H

#if defined(MLXGATE_X86)

namespace {

// ---------------------------------------------------------------------------
// Five-bit codes (Q5_0 weights at batch 1 and small batches, AVX-512).
//
// Q5_0's codes are 5 bits, but the decode step stored them as signed bytes:
// 8.5 bits per weight with f16 scales, 80% of Qwen2.5's bytes per token.
// This layout packs each 96 weights of a row into one 64-byte vector: its
// 32-bit lane i holds weight 16j + i at bits 5j (j = 0..5), as u = code +
// 16. A field at bits [P, P + 5) leaves its lane in two instructions and
// exactly: one ternary-logic op keeps the field and sets the exponent of
// 2^(23 - P), whose mantissa's bit P is worth 1, so the lane reads as the
// float 2^(23 - P) + u; one subtraction of 2^(23 - P) + 16 leaves the code.
// Fields 4 and 5 (bits 20 and up, where the exponent lies) are taken from
// the lane shifted right by 10, as fields 2 and 3 of that. No byte
// shuffles or int-to-float conversions, which bound the 8-bit loop; each
// lane's 16 weights meet 16 consecutive inputs, so the input is read in
// place. A row's last 32 weights (k = 96t + 32) are 16 u16 lanes of two
// codes; its last 64 (k = 96t + 64), 16 u32 lanes of four.
//
// Prefetching far ahead matters here: 256 bytes ahead this loop ran no
// faster than the 8-bit one despite reading 30% fewer bytes; 4 KB ahead,
// 1.1-1.4x faster over 24 layers' worth of Qwen2.5's Q5_0 matrices
// (standalone, 2 threads).

/// Bytes of one row of `k` weights in the five-bit layout.
constexpr int64_t five_bit_row_bytes(int64_t k) {
  const int64_t tail = k % 96;
  return k / 96 * 64 + (tail == 32 ? 32 : tail == 64 ? 64 : 0);
}

/// How far ahead of the codes in use the five-bit loop prefetches.
constexpr int64_t kFiveBitPrefetch = 4096;

/// The field at bits [P, P + 5) of each lane as the f32 code it holds
/// (`u - 16`), exactly.
template <int P>
AVX512 inline __m512 five_bit_codes(__m512i lanes) {
  static_assert(P >= 0 && P + 5 <= 23, "the field must lie in the mantissa");
  const __m512i value = _mm512_ternarylogic_epi32(
      lanes, _mm512_set1_epi32(31 << P), _mm512_set1_epi32((127 + 23 - P) << 23), 0xea);
  return _mm512_sub_ps(_mm512_castsi512_ps(value),
                       _mm512_set1_ps(static_cast<float>((1 << (23 - P)) + 16)));
}

/// One group of 32 weights (fields at bits `P` and `P + 5` of `lanes`)
/// against `M` inputs `x + i * k`: `acc[i] += scale * sum(code * x)`.
template <int M, int P>
AVX512 inline void five_bit_group(__m512i lanes, const float* x, int64_t k, const float& scale,
                                  __m512 (&acc)[M]) {
  const __m512 low = five_bit_codes<P>(lanes);
  const __m512 high = five_bit_codes<P + 5>(lanes);
  for (int i = 0; i < M; ++i) {
    const float* xi = x + i * k;
    const __m512 sum =
        _mm512_fmadd_ps(high, _mm512_loadu_ps(xi + 16), _mm512_mul_ps(low, _mm512_loadu_ps(xi)));
    acc[i] = _mm512_fmadd_ps(sum, _mm512_set1_ps(scale), acc[i]);
  }
}

/// Rows [n0, n1) of a five-bit matrix against inputs [m0, m0 + M). Groups
/// rotate over three sums per input so consecutive groups' FMAs overlap.
template <bool F16, int M>
AVX512 void five_bit_rows_of(const Product& p, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t groups = p.k / 32;
  const int64_t blocks = p.k / 96;
  const int64_t tail = p.k % 96;
  const int64_t row_bytes = five_bit_row_bytes(p.k);
  alignas(64) float scales[kMaxWideGroups];
  const float* x0 = p.x + m0 * p.k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* codes = p.w + n * row_bytes;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const __m512 sixteen =
          sixteen_values<F16>(p.scales, n * groups + g0, std::min<int64_t>(16, groups - g0));
      _mm512_store_ps(scales + g0, sixteen);
    }
    __m512 a[M], b[M], c[M];
    for (int i = 0; i < M; ++i) {
      a[i] = b[i] = c[i] = _mm512_setzero_ps();
    }
    const float* x = x0;
    const float* s = scales;
    for (int64_t block = 0; block < blocks; ++block, codes += 64, x += 96, s += 3) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + kFiveBitPrefetch), _MM_HINT_T0);
      __m512i lanes = _mm512_loadu_si512(codes);
      // One load into a register: left to itself the compiler reloads the
      // (often cache-line-straddling) vector for every field.
      asm volatile("" : "+v"(lanes));
      const __m512i high = _mm512_srli_epi32(lanes, 10);
      five_bit_group<M, 0>(lanes, x, p.k, s[0], a);
      five_bit_group<M, 10>(lanes, x + 32, p.k, s[1], b);
      five_bit_group<M, 10>(high, x + 64, p.k, s[2], c);
    }
    if (tail == 32) {
      const __m512i lanes =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
      five_bit_group<M, 0>(lanes, x, p.k, s[0], a);
    } else if (tail == 64) {
      const __m512i lanes = _mm512_loadu_si512(codes);
      five_bit_group<M, 0>(lanes, x, p.k, s[0], a);
      five_bit_group<M, 10>(lanes, x + 32, p.k, s[1], b);
    }
    for (int i = 0; i < M; ++i) {
      p.y[(m0 + i) * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[i], b[i]), c[i]));
    }
  }
}

/// Every input, four at a time (each block's codes unpacked once per four).
template <bool F16>
AVX512 void five_bit_rows(const Product& p, int64_t n0, int64_t n1) {
  int64_t m0 = 0;
  for (; m0 + 4 <= p.m; m0 += 4) {
    five_bit_rows_of<F16, 4>(p, m0, n0, n1);
  }
  switch (p.m - m0) {
    case 3:
      return five_bit_rows_of<F16, 3>(p, m0, n0, n1);
    case 2:
      return five_bit_rows_of<F16, 2>(p, m0, n0, n1);
    case 1:
      return five_bit_rows_of<F16, 1>(p, m0, n0, n1);
    default:
      return;
  }
}

}  // namespace

#endif  // MLXGATE_X86

#endif  // MLXGATE_QMM_FIVE_BIT_H
