// Affine-quantized matmul for x86-64 CPUs with AVX2 and FMA, as an MLX
// primitive.
//
// Why: MLX's CPU `quantized_matmul` runs on one core and costs the same per
// row at any batch size, so decode is ~10x and prefill ~17x slower than
// llama.cpp on the same weights. This kernel computes the same product
// exactly (every weight's true value `scale * q + bias`, f32 accumulation, no
// activation quantization), split across cores, and blocks prefill so each
// dequantized weight tile serves many tokens.
//
// How it stays inside MLX: `eval_cpu` only allocates the output and hands the
// work to the stream's command encoder, like MLX's own CPU ops, so it runs in
// graph order on MLX's stream thread.

#include "mlxgate_kernels.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include <dlfcn.h>

#include "kernels_common.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "primitive_support.h"

namespace mx = mlx::core;
using mlxgate::cpu_supported;
using mlxgate::Pool;

namespace {

// ---------------------------------------------------------------------------
// Kernels.

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

#if defined(MLXGATE_X86)
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

// GCC 12 warns that its own AVX-512 intrinsics read `_mm512_undefined_*()`
// values (a known false positive of those headers).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

/// Compiles one function for AVX-512 (F, BW and VL: every AVX-512 CPU since
/// Skylake-SP) as well; chosen at run time.
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

inline bool avx512_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

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
      const float* scales;
      if constexpr (L::kF16) {
        _mm512_store_ps(block, sixteen_values<true>(row.scales, g0, count));
        scales = block;
      } else {
        scales = static_cast<const float*>(row.scales) + g0;
      }
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

template <class L>
void rows_for(const Product& p, int64_t n0, int64_t n1) {
  if constexpr (L::kSplit) {
    if (p.m == 1 && p.group_size == 32 && p.k / 32 <= kMaxWideGroups && avx512_supported()) {
      return split_rows_wide<L>(p, n0, n1);
    }
  }
  if constexpr (L::kSigned) {
    if (p.m == 1 && avx512_supported()) {
      if constexpr (L::kHalves) {
        return signed_rows_wide<L, 16>(p, n0, n1);
      } else {
        return p.group_size == 32 ? signed_rows_wide<L, 32>(p, n0, n1)
                                  : signed_rows_wide<L, 0>(p, n0, n1);
      }
    }
  }
  switch (p.m) {
    case 1:
      return small_batch_rows<L, 1>(p, n0, n1);
    case 2:
      return small_batch_rows<L, 2>(p, n0, n1);
    case 3:
      return small_batch_rows<L, 3>(p, n0, n1);
    case 4:
      return small_batch_rows<L, 4>(p, n0, n1);
    default:
      return large_batch_rows<L>(p, n0, n1);
  }
}

/// Picks the instantiation for this product's storage.
template <int BITS, bool SPLIT, bool HALVES = false>
void rows_for_layout(const Product& p, int64_t n0, int64_t n1) {
  const bool derived = p.biases == nullptr;
  if (p.f16) {
    return derived ? rows_for<Layout<BITS, SPLIT, true, true, HALVES>>(p, n0, n1)
                   : rows_for<Layout<BITS, SPLIT, true, false, HALVES>>(p, n0, n1);
  }
  return derived ? rows_for<Layout<BITS, SPLIT, false, true, HALVES>>(p, n0, n1)
                 : rows_for<Layout<BITS, SPLIT, false, false, HALVES>>(p, n0, n1);
}

#endif  // MLXGATE_X86

/// Output rows per chunk: a multiple of 8, about 8 chunks per thread for
/// balance, and at least ~64K weight-input products so claiming one stays
/// cheap against computing it.
int64_t rows_per_chunk(const Product& p, int threads) {
  const int64_t work_per_row = p.k * std::min<int64_t>(p.m, 4);
  const int64_t at_least = (65536 + work_per_row - 1) / work_per_row;
  const int64_t balanced = p.n / (8 * std::max(threads, 1));
  return (std::max<int64_t>({at_least, balanced, 8}) + 7) / 8 * 8;
}

struct Chunked {
  const Product* product;
  int64_t rows;
};

void run_chunk(const void* ctx, int64_t chunk) {
#if defined(MLXGATE_X86)
  const Chunked& c = *static_cast<const Chunked*>(ctx);
  const Product& p = *c.product;
  const int64_t n0 = chunk * c.rows;
  const int64_t n1 = std::min(p.n, n0 + c.rows);
  switch (p.bits) {
    case 4:
      return p.split ? rows_for_layout<4, true>(p, n0, n1)
                     : rows_for_layout<4, false>(p, n0, n1);
    case 5:
      return p.f16 ? five_bit_rows<true>(p, n0, n1) : five_bit_rows<false>(p, n0, n1);
    default:
      return p.group_size == 16 ? rows_for_layout<8, false, true>(p, n0, n1)
                                : rows_for_layout<8, false>(p, n0, n1);
  }
#else
  (void)ctx;
  (void)chunk;
#endif
}

/// Several products as one job: chunk numbers run through each product's
/// chunks in turn.
struct ChunkedMany {
  std::vector<Product> products;
  std::vector<int64_t> rows;  // rows per chunk of each product
  std::vector<int64_t> first_chunk;  // of each product, plus the total
};

void run_many_chunk(const void* ctx, int64_t chunk) {
  const ChunkedMany& c = *static_cast<const ChunkedMany*>(ctx);
  size_t i = 0;
  while (chunk >= c.first_chunk[i + 1]) {
    ++i;
  }
  const Chunked one{&c.products[i], c.rows[i]};
  run_chunk(&one, chunk - c.first_chunk[i]);
}

void run_product(const Product& p) {
  const Chunked chunked{&p, rows_per_chunk(p, Pool::instance().threads())};
  Pool::instance().run(run_chunk, &chunked, (p.n + chunked.rows - 1) / chunked.rows);
}

// ---------------------------------------------------------------------------
// Inputs that are views (transposed, sliced, broadcast) are gathered into a
// packed copy first; weights loaded from files are already packed.

struct Packed {
  const void* data;
  std::vector<int> shape;
  std::vector<int64_t> strides;
  void* copy = nullptr;  // where to gather into, or null when already packed
};

Packed pack(const mx::array& a, mx::cpu::CommandEncoder& encoder) {
  Packed packed{a.data<void>(), {}, {}, nullptr};
  if (a.flags().row_contiguous) {
    return packed;
  }
  mx::array dense(a.shape(), a.dtype(), nullptr, {});
  dense.set_data(mx::allocator::malloc(dense.nbytes()));
  encoder.add_temporary(dense);
  packed.shape.assign(a.shape().begin(), a.shape().end());
  packed.strides.assign(a.strides().begin(), a.strides().end());
  packed.copy = dense.data<void>();
  return packed;
}

/// Copies a strided 4-byte-element view into its packed buffer.
void gather(const Packed& packed) {
  if (!packed.copy) {
    return;
  }
  const auto* src = static_cast<const uint32_t*>(packed.data);
  auto* dst = static_cast<uint32_t*>(packed.copy);
  const size_t ndim = packed.shape.size();
  int64_t total = 1;
  for (int d : packed.shape) {
    total *= d;
  }
  std::vector<int> index(ndim, 0);
  for (int64_t i = 0; i < total; ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < ndim; ++d) {
      offset += index[d] * packed.strides[d];
    }
    dst[i] = src[offset];
    for (size_t d = ndim; d-- > 0;) {
      if (++index[d] < packed.shape[d]) {
        break;
      }
      index[d] = 0;
    }
  }
}

const void* packed_data(const Packed& packed) {
  return packed.copy ? packed.copy : packed.data;
}

// ---------------------------------------------------------------------------
// The MLX primitive.

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    auto& encoder = mlxgate::begin_eval(stream(), inputs, out);
    Packed packed[4];
    for (int i = 0; i < 4; ++i) {
      packed[i] = pack(inputs[i], encoder);
    }
    const int64_t k = x.shape(-1);
    const int64_t m = k == 0 ? 0 : static_cast<int64_t>(x.size()) / k;
    const int64_t n = w.shape(0);
    float* y = out.data<float>();
    encoder.dispatch([packed_x = packed[0], packed_w = packed[1],
                      packed_s = packed[2], packed_b = packed[3], y, m, n, k,
                      group_size = group_size_, bits = bits_]() {
      for (const Packed* each : {&packed_x, &packed_w, &packed_s, &packed_b}) {
        gather(*each);
      }
      if (m == 0 || n == 0) {
        return;
      }
      if (k == 0) {
        std::memset(y, 0, sizeof(float) * m * n);
        return;
      }
      const Product product{
          static_cast<const float*>(packed_data(packed_x)),
          static_cast<const uint8_t*>(packed_data(packed_w)),
          packed_data(packed_s), packed_data(packed_b),
          y, m, n, k, group_size, bits, false, 0.0f, false};
      run_product(product);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(
        "mlxgate's quantized matmul is a CPU kernel; use MLX's on GPUs");
  }

  /// Only `x` has a gradient (the quantized base is frozen): `dy @ W`.
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int arg : argnums) {
      if (arg != 0) {
        throw std::invalid_argument(
            "[mlxgate quantized matmul] the quantized weights have no gradient");
      }
      grads.push_back(mlx_takes_group_size(group_size_)
                          ? mx::quantized_matmul(cotangents[0], primals[1], primals[2],
                                                 primals[3], /*transpose=*/false, group_size_,
                                                 bits_, "affine", stream())
                          : mx::matmul(cotangents[0], dequantized(primals), stream()));
    }
    return grads;
  }

  /// W as floats for group sizes MLX's own kernels lack (16 at 8 bits, the
  /// only such layout the loader makes): each byte a code, `scale * code +
  /// bias` per group.
  mx::array dequantized(const std::vector<mx::array>& primals) {
    if (bits_ != 8) {
      throw std::invalid_argument(
          "[mlxgate quantized matmul] no gradient for 4-bit groups MLX lacks");
    }
    const mx::Stream s = stream();
    const mx::array& w = primals[1];
    const int n = w.shape(0);
    const int k = w.shape(1) * 32 / bits_;
    const mx::array codes = mx::astype(
        mx::reshape(mx::view(w, mx::uint8, s), {n, k / group_size_, group_size_}, s),
        mx::float32, s);
    const mx::array scales = mx::expand_dims(primals[2], -1, s);
    const mx::array biases = mx::expand_dims(primals[3], -1, s);
    return mx::reshape(mx::add(mx::multiply(codes, scales, s), biases, s), {n, k}, s);
  }

  const char* name() const override {
    return "MlxgateQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* same = dynamic_cast<const QuantizedMatmul*>(&other);
    return same && same->group_size_ == group_size_ && same->bits_ == bits_;
  }

  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
};

std::string shape_text(const mx::array& a) {
  std::string text = "[";
  for (size_t i = 0; i < a.ndim(); ++i) {
    text += (i ? ", " : "") + std::to_string(a.shape(i));
  }
  return text + "]";
}

void check_operands(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("[mlxgate quantized matmul] " + what);
  };
  if (bits != 4 && bits != 8) {
    fail("bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (!takes_group_size(group_size, bits)) {
    fail("group size must be a multiple of 32 (or 16 at 8 bits), got " +
         std::to_string(group_size));
  }
  if (x.dtype() != mx::float32 || scales.dtype() != mx::float32 ||
      biases.dtype() != mx::float32) {
    fail("x, scales and biases must be float32");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    fail("w must be a 2-D uint32 array, got " + shape_text(w));
  }
  if (x.ndim() < 1) {
    fail("x must have at least one dimension");
  }
  const int64_t k = x.shape(-1);
  const int64_t n = w.shape(0);
  if (static_cast<int64_t>(w.shape(1)) * 32 / bits != k || !takes_groups(group_size, bits, k)) {
    fail("x " + shape_text(x) + " does not match w " + shape_text(w) + " at " +
         std::to_string(bits) + " bits, group size " + std::to_string(group_size));
  }
  const mx::Shape groups{static_cast<int>(n), static_cast<int>(k / group_size)};
  if (scales.shape() != groups || biases.shape() != groups) {
    fail("scales " + shape_text(scales) + " and biases " + shape_text(biases) +
         " must both be [" + std::to_string(n) + ", " +
         std::to_string(k / group_size) + "]");
  }
}

}  // namespace

extern "C" int mlxgate_kernels_supported(void) {
  return cpu_supported() ? 1 : 0;
}


extern "C" int mlxgate_blas_set_threads(int threads) {
  // Looked up at run time: OpenBLAS is linked only where the system has it.
  using Get = int (*)();
  using Set = void (*)(int);
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!get || !set) {
    return -1;
  }
  const int previous = get();
  set(threads);
  return previous;
}

extern "C" int mlxgate_kernels_set_threads(int threads) {
  return Pool::instance().set_threads(threads);
}

extern "C" int mlxgate_quantized_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    const mlx_array scales,
    const mlx_array biases,
    int group_size,
    int bits,
    const mlx_stream s,
    char* error,
    size_t error_len) {
  try {
    if (!cpu_supported()) {
      throw std::runtime_error(
          "[mlxgate quantized matmul] this CPU lacks AVX2/FMA; use MLX's kernel");
    }
    const mx::array& xa = mlx_array_get_(x);
    const mx::array& wa = mlx_array_get_(w);
    const mx::array& sa = mlx_array_get_(scales);
    const mx::array& ba = mlx_array_get_(biases);
    check_operands(xa, wa, sa, ba, group_size, bits);
    const mx::Stream& stream = mlxgate::cpu_stream(s, "[mlxgate quantized matmul]");
    mx::Shape shape = xa.shape();
    shape.back() = wa.shape(0);
    mlx_array_set_(
        *res,
        mx::array(
            std::move(shape),
            mx::float32,
            std::make_shared<QuantizedMatmul>(stream, group_size, bits),
            {xa, wa, sa, ba}));
    return 0;
  } catch (std::exception& e) {
    return mlxgate::failed(e, error, error_len);
  }
}

/// Five-bit products: groups of 32, rows of `k` weights (the wide loops
/// keep a row's scales on the stack), on a CPU with AVX-512.
bool takes_five_bit(int64_t k, int group_size) {
#if defined(MLXGATE_X86)
  return cpu_supported() && avx512_supported() && group_size == 32 && k > 0 && k % 32 == 0 &&
         k / 32 <= kMaxWideGroups;
#else
  (void)k;
  (void)group_size;
  return false;
#endif
}

extern "C" int mlxgate_kernels_five_bit_takes(int64_t k, int group_size) {
  return takes_five_bit(k, group_size) ? 1 : 0;
}

extern "C" int mlxgate_quantized_matmul_raw_many(
    const float* x,
    int64_t m,
    int64_t k,
    const mlxgate_quantized_product* products,
    int count) {
  if (!cpu_supported() || m < 0 || count < 0) {
    return 1;
  }
  ChunkedMany many;
  many.first_chunk.push_back(0);
  const int threads = Pool::instance().threads();
  for (int i = 0; i < count; ++i) {
    const mlxgate_quantized_product& q = products[i];
    if ((q.bits != 4 && q.bits != 8 && q.bits != 5) || !takes_groups(q.group_size, q.bits, k) ||
        q.n < 0 || !q.scales) {
      return 1;
    }
    if (q.bits == 5 && (q.biases || !takes_five_bit(k, q.group_size))) {
      return 1;
    }
    const Product p{x, static_cast<const uint8_t*>(q.w), q.scales, q.biases,
                    q.y, m, q.n, k, q.group_size, q.bits, q.scales_f16 != 0,
                    q.bias_offset, q.split != 0 && q.bits == 4};
    const int64_t rows = rows_per_chunk(p, threads);
    many.products.push_back(p);
    many.rows.push_back(rows);
    many.first_chunk.push_back(many.first_chunk.back() + (q.n + rows - 1) / rows);
  }
  if (m == 0 || k == 0) {
    return m == 0 ? 0 : 1;
  }
  Pool::instance().run(run_many_chunk, &many, many.first_chunk.back());
  return 0;
}

extern "C" int mlxgate_array_packed_data(const mlx_array a, const void** data) {
  try {
    mx::array& array = mlx_array_get_(a);
    if (!array.is_available()) {
      array.eval();
    }
    if (!array.flags().row_contiguous || array.data_size() != array.size()) {
      return 1;
    }
    *data = array.data<void>();
    return 0;
  } catch (std::exception&) {
    return 1;
  }
}
