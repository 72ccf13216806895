// AVX-512 loops for decode batches (2 to kMaxWideBatch inputs): each
// weight group's codes are widened once and used for several inputs, and
// each input's arithmetic is exactly that of the batch-1 loop for its
// layout (`split_rows_wide`, `signed_rows_wide`), in the same order, so a
// sequence's logits are bit for bit the same alone or in a batch.
//
// The batch-1 loops are bound by their instructions (a code's widening costs
// as much as its product); sharing the widening between inputs, with 16
// weights per instruction against the AVX2 batch loops' 8, is what lets a
// decode step of 8 sequences cost far less than 8 steps of one.
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_AVX512_BATCH_H
#define MLXGATE_QMM_AVX512_BATCH_H

#if defined(MLXGATE_X86)

namespace {

/// The most inputs the wide batch loops take: decode batches. Larger
/// products (prefill) take the tiled loop, which widens a block of rows once
/// for many inputs.
constexpr int64_t kMaxWideBatch = 16;

/// Inputs one pass over a row of a 4-bit matrix serves: their accumulators
/// (three vectors each) and a pair of groups' widened codes stay in the 32
/// vector registers. More inputs per pass measured slower: the pass is bound
/// by its multiply-adds (three per group and input), not by the widening
/// that more inputs would share.
constexpr int kWideInputs = 4;

/// Inputs one pass over a row of an 8-bit matrix serves (two accumulators
/// each). The 8-bit output head is read from memory, once a pass: a batch
/// of 8 in one pass measured 520 us an input, a batch of 4 (one pass, as
/// each of the two passes a batch of 8 took before) 646-731.
constexpr int kWideSignedInputs = 8;

/// Runs `pass.template operator()<MB>(m0)` over inputs [0, m): blocks of
/// `kBlock`, then one block of the rest.
template <int kBlock, class Pass>
AVX512 inline void in_input_blocks(int64_t m, Pass&& pass) {
  static_assert(kBlock >= 1 && kBlock <= 8, "blocks of 1 to 8 inputs");
  int64_t m0 = 0;
  for (; m0 + kBlock <= m; m0 += kBlock) {
    pass.template operator()<kBlock>(m0);
  }
  switch (m - m0) {
    case 7: if constexpr (kBlock > 7) pass.template operator()<7>(m0); break;
    case 6: if constexpr (kBlock > 6) pass.template operator()<6>(m0); break;
    case 5: if constexpr (kBlock > 5) pass.template operator()<5>(m0); break;
    case 4: if constexpr (kBlock > 4) pass.template operator()<4>(m0); break;
    case 3: if constexpr (kBlock > 3) pass.template operator()<3>(m0); break;
    case 2: if constexpr (kBlock > 2) pass.template operator()<2>(m0); break;
    case 1: if constexpr (kBlock > 1) pass.template operator()<1>(m0); break;
    default: break;
  }
}

/// A split group's 32 codes (16 bytes) as two vectors: low, high nibbles.
AVX512 inline void widen_split(const uint8_t* at, __m512i low_nibble, __m512& low, __m512& high) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble));
  high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}

/// `sum + scale * (high * x[16..32] + low * x[0..16])`: `split_group_wide`
/// (and `signed_chunk_wide`, whose 32 codes are `low`, `high`) on widened
/// codes.
AVX512 inline __m512 split_group(__m512 low, __m512 high, const float* x, const float& scale,
                                 __m512 sum) {
  const __m512 dot =
      _mm512_fmadd_ps(high, _mm512_loadu_ps(x + 16), _mm512_mul_ps(low, _mm512_loadu_ps(x)));
  return _mm512_fmadd_ps(dot, _mm512_set1_ps(scale), sum);
}

/// 16 signed 8-bit codes as a vector.
AVX512 inline __m512 widen_signed(const uint8_t* at) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
}

/// `signed_half_wide` on widened codes.
AVX512 inline __m512 signed_half(__m512 q, const float* x, const float& scale, __m512 sum) {
  return _mm512_fmadd_ps(_mm512_mul_ps(q, _mm512_loadu_ps(x)), _mm512_set1_ps(scale), sum);
}

/// One row of a split 4-bit matrix (groups of 32) against inputs
/// [m0, m0 + MB): `split_rows_wide`'s arithmetic per input. `sums` holds
/// each input's group sums, `stride` floats apart.
template <class L, int MB>
AVX512 inline void split_row_inputs(const Product& p, int64_t n, int64_t m0, const float* sums,
                                    int64_t stride) {
  const int64_t groups = p.k / 32;
  const __m512i low_nibble = _mm512_set1_epi32(0x0f);
  const __m512 neg_offset = _mm512_set1_ps(-p.bias_offset);
  const uint8_t* codes = p.w + n * p.k / 2;
  const RowGroups<L> row(p, n);
  __m512 acc[MB], other[MB], biased[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = other[m] = biased[m] = _mm512_setzero_ps();
  }
  const float* x = p.x + m0 * p.k;
  alignas(64) float block[16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t count = std::min<int64_t>(16, groups - g0);
    const __m512 scales = sixteen_values<L::kF16>(row.scales, g0, count);
    const __m512 biases = L::kDerived ? _mm512_mul_ps(scales, neg_offset)
                                      : sixteen_values<L::kF16>(row.biases, g0, count);
    for (int m = 0; m < MB; ++m) {
      biased[m] = _mm512_fmadd_ps(biases, _mm512_load_ps(sums + m * stride + g0), biased[m]);
    }
    _mm512_store_ps(block, scales);
    int64_t j = 0;
    for (; j + 2 <= count; j += 2, codes += 32, x += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + kWidePrefetch), _MM_HINT_T0);
      __m512 low0, high0, low1, high1;
      widen_split(codes, low_nibble, low0, high0);
      widen_split(codes + 16, low_nibble, low1, high1);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * p.k;
        acc[m] = split_group(low0, high0, xm, block[j], acc[m]);
        other[m] = split_group(low1, high1, xm + 32, block[j + 1], other[m]);
      }
    }
    if (j < count) {  // only a row's last block of groups can be odd
      __m512 low0, high0;
      widen_split(codes, low_nibble, low0, high0);
      for (int m = 0; m < MB; ++m) {
        acc[m] = split_group(low0, high0, x + m * p.k, block[j], acc[m]);
      }
      codes += 16;
      x += 32;
    }
  }
  for (int m = 0; m < MB; ++m) {
    p.y[(m0 + m) * p.n + n] =
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m], other[m]), biased[m]));
  }
}

/// Rows [n0, n1) of a split 4-bit matrix (groups of 32) against every
/// input (2 to kMaxWideBatch), kWideInputs at a time per row.
template <class L>
AVX512 void split_rows_wide_many(const Product& p, int64_t n0, int64_t n1) {
  const int64_t groups = p.k / 32;
  const int64_t stride = (groups + 15) / 16 * 16;
  // Each input's group sums, as `split_rows_wide` computes them; the last
  // block's unused lanes are 0 (0 * garbage can be NaN).
  std::unique_ptr<float[], decltype(&std::free)> sums(
      static_cast<float*>(std::aligned_alloc(64, sizeof(float) * p.m * stride)), &std::free);
  for (int64_t m = 0; m < p.m; ++m) {
    float* row_sums = sums.get() + m * stride;
    for (int64_t g = 0; g < groups; ++g) {
      const float* x = p.x + m * p.k + 32 * g;
      row_sums[g] =
          _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)));
    }
    std::fill(row_sums + groups, row_sums + stride, 0.0f);
  }
  for (int64_t n = n0; n < n1; ++n) {
    _mm_prefetch(reinterpret_cast<const char*>(p.w + (n + 1) * p.k / 2), _MM_HINT_T0);
    in_input_blocks<kWideInputs>(p.m, [&]<int MB>(int64_t m0) AVX512 {
      split_row_inputs<L, MB>(p, n, m0, sums.get() + m0 * stride, stride);
    });
  }
}

/// One row of a signed 8-bit matrix against inputs [m0, m0 + MB):
/// `signed_rows_wide`'s arithmetic per input, for groups of 32 (kGroup 32)
/// or 16 (kGroup 16).
template <class L, int kGroup, int MB>
AVX512 inline void signed_row_inputs(const Product& p, int64_t n, int64_t m0) {
  static_assert(kGroup == 32 || kGroup == 16, "groups of 32 or 16");
  const int64_t groups = p.k / p.group_size;
  const uint8_t* codes = p.w + n * p.k;
  const RowGroups<L> row(p, n);
  __m512 acc[MB], other[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = other[m] = _mm512_setzero_ps();
  }
  const float* x = p.x + m0 * p.k;
  alignas(64) float block[16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t count = std::min<int64_t>(16, groups - g0);
    const float* scales = sixteen_scales(row, g0, count, block);
    int64_t j = 0;
    for (; j + 2 <= count; j += 2, codes += 2 * kGroup, x += 2 * kGroup) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + kWidePrefetch), _MM_HINT_T0);
      if constexpr (kGroup == 32) {
        const __m512 a0 = widen_signed(codes), a1 = widen_signed(codes + 16);
        const __m512 b0 = widen_signed(codes + 32), b1 = widen_signed(codes + 48);
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * p.k;
          acc[m] = split_group(a0, a1, xm, scales[j], acc[m]);
          other[m] = split_group(b0, b1, xm + 32, scales[j + 1], other[m]);
        }
      } else {
        const __m512 a = widen_signed(codes), b = widen_signed(codes + 16);
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * p.k;
          acc[m] = signed_half(a, xm, scales[j], acc[m]);
          other[m] = signed_half(b, xm + 16, scales[j + 1], other[m]);
        }
      }
    }
    if (j < count) {  // only a row's last block of groups can be odd
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * p.k;
        if constexpr (kGroup == 32) {
          acc[m] = split_group(widen_signed(codes), widen_signed(codes + 16), xm, scales[j], acc[m]);
        } else {
          acc[m] = signed_half(widen_signed(codes), xm, scales[j], acc[m]);
        }
      }
      codes += kGroup;
      x += kGroup;
    }
  }
  for (int m = 0; m < MB; ++m) {
    p.y[(m0 + m) * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], other[m]));
  }
}

/// Rows [n0, n1) of a signed 8-bit matrix (groups of 32 or 16) against
/// every input (2 to kMaxWideBatch), kWideSignedInputs at a time per row.
template <class L, int kGroup>
AVX512 void signed_rows_wide_many(const Product& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    _mm_prefetch(reinterpret_cast<const char*>(p.w + (n + 1) * p.k), _MM_HINT_T0);
    in_input_blocks<kWideSignedInputs>(
        p.m, [&]<int MB>(int64_t m0) AVX512 { signed_row_inputs<L, kGroup, MB>(p, n, m0); });
  }
}

}  // namespace

#endif  // MLXGATE_X86

#endif  // MLXGATE_QMM_AVX512_BATCH_H
