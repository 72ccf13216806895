// Attention of one new query position over a sequence's cached keys and
// values, for the native decode step.
//
// Why: in MLX's graph, decode attention is a handful of small nodes per layer
// (scale, matmul, softmax, matmul) and OpenBLAS calls whose idle threads spin;
// at one query position the work is a few dot products per cached position,
// cheaper to do directly than to schedule. Same arithmetic as MLX's fallback
// (queries scaled first, softmax with the maximum subtracted, f32 throughout).

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels_common.h"
#include "mlxgate_kernels.h"

namespace {

struct DecodeAttention {
  float* out;
  const float* q;
  int heads, kv_heads, head_dim;
  const float* keys;
  const float* values;
  int64_t head_stride;
  int64_t positions;
  float scale;
};

#if defined(MLXGATE_X86)
using mlxgate::horizontal_sum;

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

/// out += w * v over n floats.
AVX2 void axpy(float* out, float w, const float* v, int n) {
  const __m256 wv = _mm256_set1_ps(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(
        out + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  }
  for (; i < n; ++i) {
    out[i] += w * v[i];
  }
}

void attend_head(const void* ctx, int64_t head) {
  const DecodeAttention& a = *static_cast<const DecodeAttention*>(ctx);
  const int d = a.head_dim;
  const int64_t group = a.heads / a.kv_heads;
  const float* keys = a.keys + (head / group) * a.head_stride;
  const float* values = a.values + (head / group) * a.head_stride;
  thread_local std::vector<float> scaled;
  thread_local std::vector<float> scores;
  scaled.resize(d);
  scores.resize(a.positions);
  for (int i = 0; i < d; ++i) {
    scaled[i] = a.q[head * d + i] * a.scale;
  }
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < a.positions; ++p) {
    scores[p] = dot(scaled.data(), keys + p * d, d);
    max = std::max(max, scores[p]);
  }
  float sum = 0.0f;
  for (int64_t p = 0; p < a.positions; ++p) {
    scores[p] = std::exp(scores[p] - max);
    sum += scores[p];
  }
  float* out = a.out + head * d;
  std::fill(out, out + d, 0.0f);
  const float inverse = 1.0f / sum;
  for (int64_t p = 0; p < a.positions; ++p) {
    axpy(out, scores[p] * inverse, values + p * d, d);
  }
}
#endif  // MLXGATE_X86

}  // namespace

extern "C" int mlxgate_decode_attention(
    float* out,
    const float* q,
    int heads,
    int kv_heads,
    int head_dim,
    const float* keys,
    const float* values,
    int64_t head_stride,
    int64_t positions,
    float scale) {
#if defined(MLXGATE_X86)
  if (!mlxgate::cpu_supported() || heads <= 0 || kv_heads <= 0 ||
      heads % kv_heads != 0 || head_dim <= 0 || positions <= 0 ||
      head_stride < positions * head_dim) {
    return 1;
  }
  const DecodeAttention attention{out, q, heads, kv_heads, head_dim, keys,
                                  values, head_stride, positions, scale};
  mlxgate::Pool::instance().run(attend_head, &attention, heads);
  return 0;
#else
  (void)out, (void)q, (void)heads, (void)kv_heads, (void)head_dim, (void)keys;
  (void)values, (void)head_stride, (void)positions, (void)scale;
  return 1;
#endif
}
