// Attention kernels: one new query position over a sequence's cached keys
// and values (the native decode step), and causal attention of a block of
// query positions (prefill, as an MLX primitive inside the graph).
//
// Why: in MLX's graph, decode attention is a handful of small nodes per layer
// (scale, matmul, softmax, matmul) and OpenBLAS calls whose idle threads spin;
// at one query position the work is a few dot products per cached position,
// cheaper to do directly than to schedule. Same arithmetic as MLX's fallback
// (queries scaled first, softmax with the maximum subtracted, f32 throughout).
//
// Prefill: MLX's CPU attention is a chain of single-threaded graph ops over
// [heads, queries, keys] score tensors (scale, mask, where, max, exp, sum,
// divide, two BLAS matmuls on one thread). Going from 128 to 512 prompt
// tokens cost our prefill 31% of its speed against llama.cpp's 7%; with this
// kernel the 512-token prefill is as fast as the 128-token one. It works per
// (head, block of query rows): only the keys a query may see are scored, exp
// is vectorized, and blocks spread over the kernel pool.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels_common.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "mlxgate_kernels.h"
#include "primitive_support.h"

namespace mx = mlx::core;

namespace {

/// A float array `[1, heads, positions, head_dim]` read through strides,
/// each row of head_dim floats contiguous.
struct Rows {
  const float* data;
  int64_t head_stride;
  int64_t row_stride;

  const float* at(int64_t head, int64_t row) const {
    return data + head * head_stride + row * row_stride;
  }
};

/// Queries `[queries, heads, head_dim]` attending over keys and values
/// `[kv_heads, keys, head_dim]`, all read through strides (rows of head_dim
/// floats contiguous). Query i sits at key index `first_query + i`: it sees
/// keys j <= first_query + i, and with a window only j > first_query + i -
/// window.
struct CausalAttention {
  float* out;  // [queries, heads, head_dim], packed
  Rows q, k, v;
  int heads, kv_heads, head_dim;
  int64_t queries, keys, first_query, window;
  float scale;
};

/// Query rows per chunk of work: enough to amortize a claim, few enough that
/// the causal triangle's long and short blocks even out across threads.
constexpr int64_t kBlockRows = 16;

#if defined(MLXGATE_X86)
using mlxgate::exp_nonpositive;
using mlxgate::horizontal_sum;

/// Four dot products of `q` with the rows at `k` (d a multiple of 8), into
/// scores[0..4).
AVX2 inline void dot4(const float* q, const float* k, int64_t row_stride, int d,
                      float* scores) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 4; ++r) {
      acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + r * row_stride + i), acc[r]);
    }
  }
  const __m256 pairs = _mm256_hadd_ps(
      _mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  _mm_storeu_ps(scores, _mm_add_ps(_mm256_castps256_ps128(pairs),
                                   _mm256_extractf128_ps(pairs, 1)));
}

/// out[0..8 * N) = sum over rows j of weights[j] * v_j[0..8 * N).
template <int N>
AVX2 inline void weighted_rows(const float* weights, const float* v, int64_t rows,
                               int64_t row_stride, float inverse, float* out) {
  __m256 acc[N];
  for (int t = 0; t < N; ++t) {
    acc[t] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < rows; ++j) {
    const __m256 w = _mm256_broadcast_ss(weights + j);
    const float* row = v + j * row_stride;
    for (int t = 0; t < N; ++t) {
      acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * t), acc[t]);
    }
  }
  const __m256 inv = _mm256_set1_ps(inverse);
  for (int t = 0; t < N; ++t) {
    _mm256_storeu_ps(out + 8 * t, _mm256_mul_ps(acc[t], inv));
  }
}

AVX2 float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

/// One query row of one head.
AVX2 void attend_row(const CausalAttention& a, int head, int64_t row) {
  const int d = a.head_dim;
  const int kv = head / (a.heads / a.kv_heads);
  float* out = a.out + (row * a.heads + head) * d;
  const int64_t at = a.first_query + row;
  const int64_t hi = std::min(at, a.keys - 1);
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, at - a.window + 1) : 0;
  if (hi < lo) {
    std::fill(out, out + d, 0.0f);
    return;
  }
  const int64_t count = hi - lo + 1;
  thread_local std::vector<float> scaled;
  thread_local std::vector<float> scores;
  scaled.resize(d);
  scores.resize(count + 8);
  const float* q = a.q.at(head, row);
  for (int i = 0; i < d; ++i) {
    scaled[i] = q[i] * a.scale;
  }
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    dot4(scaled.data(), a.k.at(kv, lo + j), a.k.row_stride, d, scores.data() + j);
  }
  for (; j < count; ++j) {
    scores[j] = dot(scaled.data(), a.k.at(kv, lo + j), d);
  }
  // Softmax numerators, vectorized; the tail is padded with -inf -> 0.
  const int64_t padded = (count + 7) / 8 * 8;
  __m256 maxv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (j = count; j < padded; ++j) {
    scores[j] = -std::numeric_limits<float>::infinity();
  }
  for (j = 0; j < padded; j += 8) {
    maxv = _mm256_max_ps(maxv, _mm256_loadu_ps(scores.data() + j));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(maxv), _mm256_extractf128_ps(maxv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 max = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 sumv = _mm256_setzero_ps();
  for (j = 0; j < padded; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + j), max));
    if (j + 8 > count) {  // the padded tail: exactly zero
      const __m256 index = _mm256_add_ps(
          _mm256_set1_ps(static_cast<float>(j)),
          _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
      e = _mm256_and_ps(e, _mm256_cmp_ps(index, _mm256_set1_ps(static_cast<float>(count)),
                                         _CMP_LT_OQ));
    }
    _mm256_storeu_ps(scores.data() + j, e);
    sumv = _mm256_add_ps(sumv, e);
  }
  const float inverse = 1.0f / horizontal_sum(sumv);
  const float* v = a.v.at(kv, lo);
  int i = 0;
  for (; i + 64 <= d; i += 64) {
    weighted_rows<8>(scores.data(), v + i, count, a.v.row_stride, inverse, out + i);
  }
  for (; i < d; i += 8) {
    weighted_rows<1>(scores.data(), v + i, count, a.v.row_stride, inverse, out + i);
  }
}


/// Several sequences' decode attention of one layer: chunk c is head
/// c % heads of sequence c / heads.
struct DecodeRows {
  const mlxgate_attention_row* rows;
  int heads, kv_heads, head_dim;
  float scale;

  /// Sequence `i`'s attention: its one query row at the last position.
  CausalAttention of(int64_t i) const {
    const mlxgate_attention_row& r = rows[i];
    return CausalAttention{r.out, Rows{r.q, head_dim, heads * int64_t{head_dim}},
                           Rows{r.keys, r.head_stride, head_dim},
                           Rows{r.values, r.head_stride, head_dim}, heads, kv_heads, head_dim,
                           1, r.positions, r.positions - 1, 0, scale};
  }
};

void attend_sequence_head(const void* ctx, int64_t chunk) {
  const DecodeRows& d = *static_cast<const DecodeRows*>(ctx);
  attend_row(d.of(chunk / d.heads), static_cast<int>(chunk % d.heads), 0);
}

/// Chunk c: one head, one block of query rows; the last (longest) blocks
/// first, so the pool's dynamic claiming evens out the causal triangle.
void attend_block(const void* ctx, int64_t chunk) {
  const CausalAttention& a = *static_cast<const CausalAttention*>(ctx);
  const int64_t blocks = (a.queries + kBlockRows - 1) / kBlockRows;
  const int head = static_cast<int>(chunk % a.heads);
  const int64_t block = blocks - 1 - chunk / a.heads;
  const int64_t end = std::min(a.queries, (block + 1) * kBlockRows);
  for (int64_t row = block * kBlockRows; row < end; ++row) {
    attend_row(a, head, row);
  }
}
#endif  // MLXGATE_X86

}  // namespace

extern "C" int mlxgate_decode_attention_many(
    const mlxgate_attention_row* rows,
    int64_t count,
    int heads,
    int kv_heads,
    int head_dim,
    float scale) {
#if defined(MLXGATE_X86)
  if (!mlxgate::cpu_supported() || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 ||
      head_dim <= 0 || head_dim % 8 != 0 || count < 0) {
    return 1;
  }
  for (int64_t i = 0; i < count; ++i) {
    if (rows[i].positions <= 0 || rows[i].head_stride < rows[i].positions * head_dim) {
      return 1;
    }
  }
  const DecodeRows decode{rows, heads, kv_heads, head_dim, scale};
  mlxgate::Pool::instance().run(attend_sequence_head, &decode, count * heads);
  return 0;
#else
  (void)rows, (void)count, (void)heads, (void)kv_heads, (void)head_dim, (void)scale;
  return 1;
#endif
}


// ---------------------------------------------------------------------------
// Causal attention as an MLX primitive (prefill inside the graph).

namespace {

/// One input of the primitive: its rows in place, or (rows not contiguous)
/// a packed copy that `gather` fills on the stream thread.
struct Operand {
  Rows rows;
  const float* source;
  mx::Strides strides;
  mx::Shape shape;
  bool copied;

  Operand(const mx::array& a, mx::cpu::CommandEncoder& encoder)
      : source(a.data<float>()), strides(a.strides()), shape(a.shape()), copied(a.strides(3) != 1) {
    if (!copied) {
      rows = Rows{source, static_cast<int64_t>(strides[1]), static_cast<int64_t>(strides[2])};
      return;
    }
    mx::array copy(a.shape(), mx::float32, nullptr, {});
    copy.set_data(mx::allocator::malloc(copy.nbytes()));
    encoder.add_temporary(copy);
    rows = Rows{copy.data<float>(), static_cast<int64_t>(shape[2]) * shape[3], shape[3]};
  }

  void gather() const {
    if (!copied) {
      return;
    }
    float* dst = const_cast<float*>(rows.data);
    for (int64_t h = 0; h < shape[1]; ++h) {
      for (int64_t r = 0; r < shape[2]; ++r) {
        for (int64_t c = 0; c < shape[3]; ++c) {
          *dst++ = source[h * strides[1] + r * strides[2] + c * strides[3]];
        }
      }
    }
  }
};

class CausalAttentionOp : public mx::UnaryPrimitive {
 public:
  CausalAttentionOp(mx::Stream stream, float scale, int64_t first_query, int64_t window)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        first_query_(first_query),
        window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = mlxgate::begin_eval(stream(), inputs, out);
    const mx::array& q = inputs[0];
    const mx::array& k = inputs[1];
    Operand q_in(q, encoder), k_in(k, encoder), v_in(inputs[2], encoder);
    const CausalAttention a{out.data<float>(), q_in.rows, k_in.rows, v_in.rows,
                            q.shape(1), k.shape(1), q.shape(3), q.shape(2), k.shape(2),
                            first_query_, window_, scale_};
    encoder.dispatch([a, q_in, k_in, v_in]() {
      q_in.gather();
      k_in.gather();
      v_in.gather();
#if defined(MLXGATE_X86)
      const int64_t blocks = (a.queries + kBlockRows - 1) / kBlockRows;
      mlxgate::Pool::instance().run(attend_block, &a, blocks * a.heads);
#endif
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(
        "mlxgate's causal attention is a CPU kernel; use MLX's on GPUs");
  }

  const char* name() const override {
    return "MlxgateCausalAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* same = dynamic_cast<const CausalAttentionOp*>(&other);
    return same && same->scale_ == scale_ && same->first_query_ == first_query_ &&
        same->window_ == window_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const mx::array& q = inputs[0];
    return {{1, q.shape(2), q.shape(1), q.shape(3)}};
  }

 private:
  float scale_;
  int64_t first_query_;
  int64_t window_;
};

}  // namespace

extern "C" int mlxgate_causal_attention(
    mlx_array* res,
    const mlx_array q,
    const mlx_array k,
    const mlx_array v,
    float scale,
    int64_t first_query,
    int64_t window,
    const mlx_stream s,
    char* error,
    size_t error_len) {
  try {
    if (!mlxgate::cpu_supported()) {
      throw std::runtime_error(
          "[mlxgate causal attention] this CPU lacks AVX2/FMA; use MLX's attention");
    }
    const mx::array& qa = mlx_array_get_(q);
    const mx::array& ka = mlx_array_get_(k);
    const mx::array& va = mlx_array_get_(v);
    auto fail = [](const std::string& what) {
      throw std::invalid_argument("[mlxgate causal attention] " + what);
    };
    for (const mx::array* a : {&qa, &ka, &va}) {
      if (a->dtype() != mx::float32 || a->ndim() != 4 || a->shape(0) != 1) {
        fail("q, k and v must be float32 [1, heads, positions, head_dim]");
      }
    }
    if (ka.shape() != va.shape() || ka.shape(3) != qa.shape(3)) {
      fail("k and v must have equal shapes and q's head_dim");
    }
    if (qa.shape(3) % 8 != 0) {
      fail("head_dim must be a multiple of 8, got " + std::to_string(qa.shape(3)));
    }
    if (qa.shape(1) % ka.shape(1) != 0) {
      fail("heads (" + std::to_string(qa.shape(1)) + ") must be a multiple of kv heads (" +
           std::to_string(ka.shape(1)) + ")");
    }
    if (window < 0) {
      fail("window must be >= 0");
    }
    const mx::Stream& stream = mlxgate::cpu_stream(s, "[mlxgate causal attention]");
    mx::Shape shape{1, qa.shape(2), qa.shape(1), qa.shape(3)};
    mlx_array_set_(
        *res,
        mx::array(
            std::move(shape),
            mx::float32,
            std::make_shared<CausalAttentionOp>(stream, scale, first_query, window),
            {qa, ka, va}));
    return 0;
  } catch (std::exception& e) {
    return mlxgate::failed(e, error, error_len);
  }
}
