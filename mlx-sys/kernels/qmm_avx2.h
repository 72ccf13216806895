// AVX2 + FMA kernels for decode and small batches (M <= 4): the storage
// layouts as template parameters (`Layout`), a row's scales and biases,
// 32-weight chunks dequantized in registers, `small_batch_rows`.
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_AVX2_H
#define MLXGATE_QMM_AVX2_H

#if defined(MLXGATE_X86)

namespace {

using mlxgate::horizontal_sum;

/// How a matrix is stored, as template parameters: 4-bit codes (in MLX's
/// order or split, see `Product::split`) or 8-bit codes; f32 or f16 scales
/// and biases; biases stored or derived from the scales; groups of 16 (two
/// per 32-weight chunk) or of a multiple of 32. A compile-time choice each,
/// so the usual layouts pay no branch for the others (a run-time test per
/// chunk cost SmolLM2 decode ~18%).
template <int Bits, bool Split, bool F16, bool Derived, bool Halves = false>
struct Layout {
  static constexpr int kBits = Bits;
  static constexpr bool kSplit = Split;
  static constexpr bool kF16 = F16;
  static constexpr bool kDerived = Derived;
  static constexpr bool kHalves = Halves;
  /// 8-bit codes of a symmetric matrix are stored signed, `q - offset`, and
  /// each weight is `scale * code` (no bias).
  static constexpr bool kSigned = Bits == 8 && Derived;
};

/// The groups of chunk `c`'s two halves (16 weights each): the same group
/// unless groups are 16 weights (Q6_K's sub-blocks).
struct ChunkGroups {
  int64_t first, second;
};

/// Maps chunks to groups, by shift for the usual power-of-two group sizes (a
/// division per chunk costs as much as the chunk's arithmetic).
template <class L>
class GroupOfChunk {
 public:
  explicit GroupOfChunk(int group_size)
      : chunks_per_group_(std::max(group_size / 32, 1)),
        power_of_two_((chunks_per_group_ & (chunks_per_group_ - 1)) == 0),
        shift_(__builtin_ctzll(static_cast<uint64_t>(chunks_per_group_))) {}

  ChunkGroups operator()(int64_t c) const {
    if constexpr (L::kHalves) {
      return {2 * c, 2 * c + 1};
    }
    const int64_t g = power_of_two_ ? c >> shift_ : c / chunks_per_group_;
    return {g, g};
  }

 private:
  int64_t chunks_per_group_;
  bool power_of_two_;
  int shift_;
};

/// One row's scales and biases.
template <class L>
struct RowGroups {
  const void* scales;
  const void* biases;
  __m256 neg_offset;

  AVX2 RowGroups(const Product& p, int64_t n) {
    const int64_t groups = p.k / p.group_size;
    const size_t width = L::kF16 ? 2 : 4;
    scales = static_cast<const uint8_t*>(p.scales) + n * groups * width;
    biases = L::kDerived ? nullptr
                         : static_cast<const uint8_t*>(p.biases) + n * groups * width;
    neg_offset = _mm256_set1_ps(-p.bias_offset);
  }

  AVX2 static __m256 value(const void* values, int64_t g) {
    if constexpr (L::kF16) {
      return _mm256_set1_ps(_cvtsh_ss(static_cast<const uint16_t*>(values)[g]));
    } else {
      return _mm256_broadcast_ss(static_cast<const float*>(values) + g);
    }
  }

  /// Group `g`'s scale and bias, broadcast. A derived bias is the same f32
  /// product the stored one was made by, so results do not change.
  AVX2 void at(int64_t g, __m256& scale, __m256& bias) const {
    scale = value(scales, g);
    bias = L::kDerived ? _mm256_mul_ps(scale, neg_offset) : value(biases, g);
  }

  /// Both halves' scales and biases of a chunk in groups `g`.
  AVX2 void at(ChunkGroups g, __m256 (&scale)[2], __m256 (&bias)[2]) const {
    at(g.first, scale[0], bias[0]);
    if constexpr (L::kHalves) {
      at(g.second, scale[1], bias[1]);
    } else {
      scale[1] = scale[0];
      bias[1] = bias[0];
    }
  }
};

/// 32 weight codes starting at `p` as four vectors of 8 floats, in order.
template <int BITS, bool SPLIT = false>
AVX2 inline void load_codes(const uint8_t* p, __m256 q[4]) {
  if constexpr (SPLIT) {
    // Byte l: weight l (low nibble), weight l + 16 (high nibble).
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
      q[half] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask));
      q[2 + half] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
  } else if constexpr (BITS == 4) {
    // Each 32-bit word holds 8 codes, code j in bits 4j..4j+3: broadcast the
    // word and shift each lane by its own amount. No cross-lane shuffles,
    // which were the bottleneck of unpacking bytes.
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int i = 0; i < 4; ++i) {
      int32_t word;
      std::memcpy(&word, p + 4 * i, sizeof(word));
      const __m256i codes =
          _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
      q[i] = _mm256_cvtepi32_ps(codes);
    }
  } else {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes =
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    }
  }
}

/// 32 signed 8-bit codes as four vectors of 8 floats.
AVX2 inline void load_signed_codes(const uint8_t* p, __m256 q[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
    q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}

/// Chunk `c` (32 weights, in groups `g`) of one row against every input,
/// into the four accumulators per input starting at `first`.
template <class L, int M, int A>
AVX2 inline void chunk_into(
    const Product& p,
    const uint8_t* w,
    const RowGroups<L>& groups,
    int64_t c,
    ChunkGroups g,
    int first,
    __m256 (&acc)[M][A]) {
  constexpr int64_t kChunkBytes = 32 * L::kBits / 8;
  const uint8_t* codes = w + c * kChunkBytes;
  _mm_prefetch(reinterpret_cast<const char*>(codes + 4 * kChunkBytes), _MM_HINT_T0);
  __m256 q[4];
  if constexpr (L::kSigned) {
    // scale * sum(code * x) over the chunk: the weights `scale * code` are
    // exact products, and scaling once per chunk saves a multiply-add per
    // 8 weights (decode is bound by such instructions as much as by memory).
    const __m256 scale = RowGroups<L>::value(groups.scales, g.first);
    load_signed_codes(codes, q);
    if constexpr (L::kHalves) {
      // Groups of 16: each half scaled by its own group's scale.
      const __m256 second = RowGroups<L>::value(groups.scales, g.second);
      for (int m = 0; m < M; ++m) {
        const float* x = p.x + m * p.k + c * 32;
        const __m256 low =
            _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(x)));
        const __m256 high = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24),
                                            _mm256_mul_ps(q[2], _mm256_loadu_ps(x + 16)));
        acc[m][first] = _mm256_fmadd_ps(low, scale, acc[m][first]);
        acc[m][first + 1] = _mm256_fmadd_ps(high, second, acc[m][first + 1]);
      }
      return;
    }
    for (int m = 0; m < M; ++m) {
      const float* x = p.x + m * p.k + c * 32;
      __m256 even = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
      __m256 odd = _mm256_mul_ps(q[1], _mm256_loadu_ps(x + 8));
      even = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), even);
      odd = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), odd);
      acc[m][first] = _mm256_fmadd_ps(_mm256_add_ps(even, odd), scale, acc[m][first]);
    }
    return;
  }
  __m256 scale[2], bias[2];
  groups.at(g, scale, bias);
  load_codes<L::kBits, L::kSplit>(codes, q);
  for (int i = 0; i < 4; ++i) {
    const __m256 weight = _mm256_fmadd_ps(q[i], scale[i / 2], bias[i / 2]);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(p.x + m * p.k + c * 32 + 8 * i);
      acc[m][first + i] = _mm256_fmadd_ps(weight, xv, acc[m][first + i]);
    }
  }
}

/// Decode and small batches: rows [n0, n1) against all M (<= 4) inputs,
/// dequantizing each 32-weight chunk in registers as it streams past.
/// Sums are spread over 4 accumulators per input (8 at batch 1, two chunks
/// per step) so the FMA latency chains never wait on each other.
template <class L, int M>
AVX2 void small_batch_rows(const Product& p, int64_t n0, int64_t n1) {
  constexpr int kUnroll = M == 1 ? 2 : 1;  // chunks per step
  const int64_t row_bytes = p.k * L::kBits / 8;
  const int64_t chunks = p.k / 32;
  const GroupOfChunk<L> group_of(p.group_size);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * row_bytes;
    const RowGroups<L> groups(p, n);
    _mm_prefetch(reinterpret_cast<const char*>(w + row_bytes), _MM_HINT_T0);
    __m256 acc[M][4 * kUnroll];
    for (int m = 0; m < M; ++m) {
      for (int a = 0; a < 4 * kUnroll; ++a) {
        acc[m][a] = _mm256_setzero_ps();
      }
    }
    int64_t c = 0;
    for (; c + kUnroll <= chunks; c += kUnroll) {
      for (int u = 0; u < kUnroll; ++u) {
        chunk_into<L>(p, w, groups, c + u, group_of(c + u), 4 * u, acc);
      }
    }
    for (; c < chunks; ++c) {
      chunk_into<L>(p, w, groups, c, group_of(c), 0, acc);
    }
    for (int m = 0; m < M; ++m) {
      __m256 sum = acc[m][0];
      for (int a = 1; a < 4 * kUnroll; ++a) {
        sum = _mm256_add_ps(sum, acc[m][a]);
      }
      p.y[m * p.n + n] = horizontal_sum(sum);
    }
  }
}

}  // namespace

#endif  // MLXGATE_X86

#endif  // MLXGATE_QMM_AVX2_H
