// AVX-512 batch-1 loops, chosen at run time where the CPU has AVX-512:
// signed 8-bit codes (`signed_rows_wide`) and split 4-bit codes
// (`split_rows_wide`), 16 weights per instruction.
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_AVX512_H
#define MLXGATE_QMM_AVX512_H

#if defined(MLXGATE_X86)

namespace {

// GCC 12 warns that its own AVX-512 intrinsics read `_mm512_undefined_*()`
// values (a known false positive of those headers).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using mlxgate::avx512_supported;

/// Sixteen groups' scales (or biases) from `values` + g0 as f32 vector
/// lanes; lanes from `count` on are zero.
template <bool F16>
AVX512 inline __m512 sixteen_values(const void* values, int64_t g0, int64_t count) {
  if constexpr (F16) {
    // A masked load, not a copy through the stack: a vector load of
    // freshly stored pieces cannot be forwarded from the stores and stalled
    // each row (17% of the five-bit loop's samples on Qwen2.5's 28-group
    // rows).
    const auto* halves = static_cast<const uint16_t*>(values) + g0;
    const __mmask16 live = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, halves));
  } else {
    const __mmask16 live = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
    return _mm512_maskz_loadu_ps(live, static_cast<const float*>(values) + g0);
  }
}

/// Sixteen of a row's scales from group `g0` on, as f32 in memory for
/// broadcast operands: the row's own f32 scales, or its f16 ones converted
/// into `block` (one conversion per 16 groups).
template <class L>
AVX512 inline const float* sixteen_scales(const RowGroups<L>& row, int64_t g0, int64_t count,
                                          float* block) {
  if constexpr (L::kF16) {
    _mm512_store_ps(block, sixteen_values<true>(row.scales, g0, count));
    return block;
  } else {
    (void)count;
    return static_cast<const float*>(row.scales) + g0;
  }
}

/// How far ahead of the codes in use the wide (AVX-512) batch-1 loops
/// prefetch. Decode streams every weight from memory once per token, and a
/// few cache lines ahead (the old distance, 128 bytes) is less than memory's
/// latency at these rates: 2 KB ahead, Qwen2.5 decode ran 54.2 against
/// 51.1 tok/s (mean of 5 alternating runs, 4 won).
constexpr int64_t kWidePrefetch = 2048;

/// `acc + scale * sum(codes[i] * x[i])` over one chunk of 32 signed 8-bit
/// codes; the scale is a broadcast memory operand of the last FMA.
AVX512 inline __m512 signed_chunk_wide(const uint8_t* codes, const float* x, const float& scale,
                                       __m512 acc) {
  _mm_prefetch(reinterpret_cast<const char*>(codes + kWidePrefetch), _MM_HINT_T0);
  const __m512 q0 = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 q1 = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  const __m512 sum =
      _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(x)));
  return _mm512_fmadd_ps(sum, _mm512_set1_ps(scale), acc);
}

/// `acc + scale * codes[i] * x[i]` over 16 signed 8-bit codes (groups of
/// 16).
AVX512 inline __m512 signed_half_wide(const uint8_t* codes, const float* x, const float& scale,
                                      __m512 acc) {
  _mm_prefetch(reinterpret_cast<const char*>(codes + kWidePrefetch), _MM_HINT_T0);
  const __m512 q = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  return _mm512_fmadd_ps(_mm512_mul_ps(q, _mm512_loadu_ps(x)), _mm512_set1_ps(scale), acc);
}

/// Batch-1 rows of a signed 8-bit matrix with AVX-512: `small_batch_rows`'
/// signed path 16 weights per instruction, half the instructions (decode is
/// bound by them as much as by memory: Qwen2.5 decode +7% in 8 alternating
/// pairs of runs). Split 4-bit codes have their own AVX-512 loop
/// (`split_rows_wide`); the other layouts stay on AVX2 (table lookups for
/// 4/5-bit codes were tried and gained nothing).
template <class L, int kGroup>
AVX512 void signed_rows_wide(const Product& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.k / p.group_size;
  // kGroup: a compile-time 32 (Q5_0/Q8_0) or 16 (Q6_K), so the loop over a
  // group's chunks disappears; 0 for other multiples of 32. No division by
  // the group size anywhere.
  const int64_t chunks_per_group = kGroup == 0 ? p.group_size / 32 : 1;
  // Sixteen of a row's scales at a time as f32 on the stack, so each group
  // takes its scale as a broadcast memory operand of the FMA: one f16
  // conversion per 16 groups instead of an insert, a conversion and a
  // broadcast per group.
  alignas(64) float block[16];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * p.k;
    const RowGroups<L> row(p, n);
    _mm_prefetch(reinterpret_cast<const char*>(w + p.k), _MM_HINT_T0);
    // Two sums, alternating chunk by chunk, so consecutive chunks' FMAs
    // overlap.
    __m512 acc = _mm512_setzero_ps();
    __m512 other = _mm512_setzero_ps();
    const uint8_t* codes = w;
    const float* x = p.x;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      const float* scales = sixteen_scales(row, g0, count, block);
      if constexpr (kGroup == 16) {
        // A scale per 16 weights: each product scaled on its own, groups
        // alternating between the two sums.
        int64_t j = 0;
        for (; j + 2 <= count; j += 2, codes += 32, x += 32) {
          acc = signed_half_wide(codes, x, scales[j], acc);
          other = signed_half_wide(codes + 16, x + 16, scales[j + 1], other);
        }
        if (j < count) {
          acc = signed_half_wide(codes, x, scales[j], acc);
          codes += 16;
          x += 16;
        }
      } else if constexpr (kGroup == 32) {
        // Even and odd groups into their own sums, unrolled by hand: no
        // register moves for a swap in the loop.
        int64_t j = 0;
        for (; j + 2 <= count; j += 2, codes += 64, x += 64) {
          acc = signed_chunk_wide(codes, x, scales[j], acc);
          other = signed_chunk_wide(codes + 32, x + 32, scales[j + 1], other);
        }
        if (j < count) {  // only a row's last block of groups can be odd
          acc = signed_chunk_wide(codes, x, scales[j], acc);
        }
      } else {
        for (int64_t j = 0; j < count; ++j) {
          for (int64_t i = 0; i < chunks_per_group; ++i, codes += 32, x += 32) {
            acc = signed_chunk_wide(codes, x, scales[j], acc);
            std::swap(acc, other);
          }
        }
      }
    }
    p.y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc, other));
  }
}

/// Groups of 32 per row the wide split kernel takes (its per-group input
/// sums live on the stack): K up to 32,768.
constexpr int64_t kMaxWideGroups = 1024;

/// `acc + scale * sum(q[i] * x[i])` over one split group of 32 4-bit codes
/// (16 bytes: byte l holds weight l in its low nibble, l + 16 in its high).
AVX512 inline __m512 split_group_wide(const uint8_t* codes, const float* x, const float& scale,
                                      __m512i low_nibble, __m512 acc) {
  _mm_prefetch(reinterpret_cast<const char*>(codes + kWidePrefetch), _MM_HINT_T0);
  const __m512i bytes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  const __m512 sum =
      _mm512_fmadd_ps(high, _mm512_loadu_ps(x + 16), _mm512_mul_ps(low, _mm512_loadu_ps(x)));
  return _mm512_fmadd_ps(sum, _mm512_set1_ps(scale), acc);
}

/// Batch-1 rows of a split 4-bit matrix (groups of 32) with AVX-512: per
/// group `scale * sum(q * x) + bias * sum(x)`, the input's group sums
/// computed once per call, so a weight costs no multiply-add of its own
/// scale and bias. 16 weights per instruction against 8 for
/// `small_batch_rows`, which was bound by its instructions (Qwen2.5's Q4_K
/// weights streamed at ~11 GB/s there against ~28 GB/s for the 8-bit ones).
template <class L>
AVX512 void split_rows_wide(const Product& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.k / 32;
  alignas(64) float sums[kMaxWideGroups];
  for (int64_t g = 0; g < groups; ++g) {
    const float* x = p.x + 32 * g;
    sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)));
  }
  // The last block of 16 groups reads whole vectors: its unused lanes are 0
  // (their biases are masked to 0 too, but 0 * garbage can be NaN).
  std::fill(sums + groups, sums + (groups + 15) / 16 * 16, 0.0f);
  const __m512i low_nibble = _mm512_set1_epi32(0x0f);
  const __m512 neg_offset = _mm512_set1_ps(-p.bias_offset);
  alignas(64) float block[16];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* codes = p.w + n * p.k / 2;
    const RowGroups<L> row(p, n);
    _mm_prefetch(reinterpret_cast<const char*>(codes + p.k / 2), _MM_HINT_T0);
    __m512 acc = _mm512_setzero_ps();
    __m512 other = _mm512_setzero_ps();
    __m512 biased = _mm512_setzero_ps();  // sum over groups of bias * sum(x)
    const float* x = p.x;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      const __m512 scales = sixteen_values<L::kF16>(row.scales, g0, count);
      const __m512 biases = L::kDerived ? _mm512_mul_ps(scales, neg_offset)
                                        : sixteen_values<L::kF16>(row.biases, g0, count);
      biased = _mm512_fmadd_ps(biases, _mm512_load_ps(sums + g0), biased);
      _mm512_store_ps(block, scales);
      // Even and odd groups into their own sums, so their FMAs overlap.
      int64_t j = 0;
      for (; j + 2 <= count; j += 2, codes += 32, x += 64) {
        acc = split_group_wide(codes, x, block[j], low_nibble, acc);
        other = split_group_wide(codes + 16, x + 32, block[j + 1], low_nibble, other);
      }
      if (j < count) {  // only a row's last block of groups can be odd
        acc = split_group_wide(codes, x, block[j], low_nibble, acc);
        codes += 16;
        x += 32;
      }
    }
    p.y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc, other), biased));
  }
}

}  // namespace

#endif  // MLXGATE_X86

#endif  // MLXGATE_QMM_AVX512_H
