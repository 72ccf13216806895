// One decode step's attention for a batch whose rows start at different
// columns of a shared key/value slab (`transformer::slab` in mlxgate), as a
// CUDA kernel MLX compiles at first use (`mlx::core::fast::cuda_kernel`).
//
// Why: MLX's fused decode attention (its vector kernel) takes no array
// mask, so a batch of rows of different lengths fell back to unfused
// matmul-softmax-matmul over every row's columns rounded up to a bucket,
// with copies of the sliced slab. This kernel reads each row's own columns,
// `start[row] ..= end`, of the whole slab in place: one kernel a layer.
//
// Layout: q and out [rows, heads * D]; k and v [rows, kv_heads, columns, D]
// with any strides but a packed last dimension; starts int32 [rows]; end
// int32 [1] (the last column, the same for every row); scale float32 [1];
// k_new and v_new packed [rows, kv_heads, D] (read only when WRITE is 1).
//
// WRITE = 1: the kernel first writes this step's key and value (k_new,
// v_new) into column `end` of k and v, in place, then attends. MLX writes
// an array by slice update, which copies the whole slab unless it may
// donate the buffer, and on CUDA it may not while the step before is still
// running: MLX's CUDA eval keeps every input of a step's ops alive until
// the step's kernels finish (mlx/backend/cuda/eval.cpp, 0.32.1), and a step
// launched ahead always finds the slab so held. Written here, no copy: the
// column is one no other kernel of the step reads (the caches' views and
// copies cover earlier columns), steps run in order on one stream, and
// the block's own threads read it after `__syncthreads`. Blocks of query
// heads that share a key/value head write the same values.
// Each warp takes every WARPS-th column with an online softmax in float32,
// and the warps are merged at the end. Two bodies:
// - per key/value head (GQA <= 8, steps of 2+ rows): a block of 256
//   threads (eight warps) per (key/value head, row) reads each column once
//   for all GQA query heads it serves. On an H200 (3B shapes, 28 layers,
//   300 columns) it took 0.54 / 0.94 / 1.91 ms at 8 / 32 / 128 rows against
//   0.76 / 1.25 / 2.88 for the per-head body.
// - per query head (any GQA, and one-row steps): a block of 128 threads
//   (four warps) per (head, row), reading a key/value head's columns once
//   per query head. A one-row step of 8 key/value heads would be 8 blocks
//   the other way; this way it is 24-32, and on an H100 (3B shapes, 1,000
//   columns) took 0.53 ms against 0.70. (Splitting each row's columns
//   between blocks and merging their partial sums in a second kernel was
//   slower there at 1-8 rows: 1.0 ms.)

#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "primitive_support.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "mlx/fast.h"
#include "mlxgate_kernels.h"

namespace mx = mlx::core;

namespace {

// What both bodies call (MLX puts it before each kernel, as its header).
const char* kWriteColumnSource = R"write_column(
// Copies the step's key and value of `row` and `kv_head` (k_new and v_new,
// packed [rows, kv_heads, D]) into column `last` of k and v, in place (see
// the file's head): one warp, PER values a lane.
template <int PER, typename T, typename S>
__device__ void write_column(const T* k, const T* v, const S& k_strides, const S& v_strides,
                             const T* k_new, const T* v_new, int row, int kv_head, int kv_heads,
                             int last, int lane) {
  const size_t from = ((size_t)row * kv_heads + kv_head) * (32 * PER) + lane * PER;
  T* kw = const_cast<T*>(k) + row * k_strides[0] + kv_head * k_strides[1] + last * k_strides[2] + lane * PER;
  T* vw = const_cast<T*>(v) + row * v_strides[0] + kv_head * v_strides[1] + last * v_strides[2] + lane * PER;
  for (int i = 0; i < PER; i++) {
    kw[i] = k_new[from + i];
    vw[i] = v_new[from + i];
  }
}
)write_column";

// The kernels' bodies; MLX writes their signatures from the names below.
// scripts/gpu/attention_probe.py (on a GPU) and scripts/gpu/check_kernels.sh
// (emulated on the CPU, in CI) read them from here, between the markers.
const char* kPerHeadSource = R"per_head(
  constexpr int WARPS = 4;
  constexpr int PER = D / 32;
  const int head = blockIdx.x;
  const int row = blockIdx.y;
  const int heads = gridDim.x;
  const int kv_head = head / GQA;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int last = end[0];
  const int first = starts[row];
  const float s = scale[0];
  if (WRITE) {
    if (warp == 0) {
      write_column<PER>(k, v, k_strides, v_strides, k_new, v_new, row, kv_head, heads / GQA, last, lane);
    }
    __syncthreads();
  }
  const T* qp = q + ((size_t)row * heads + head) * D + lane * PER;
  float qv[PER];
  for (int i = 0; i < PER; i++) {
    qv[i] = static_cast<float>(qp[i]) * s;
  }
  const T* kp = k + row * k_strides[0] + kv_head * k_strides[1] + lane * PER;
  const T* vp = v + row * v_strides[0] + kv_head * v_strides[1] + lane * PER;
  float m = -INFINITY;
  float l = 0.0f;
  float acc[PER];
  for (int i = 0; i < PER; i++) {
    acc[i] = 0.0f;
  }
  for (int j = first + warp; j <= last; j += WARPS) {
    const T* kj = kp + j * k_strides[2];
    float score = 0.0f;
    for (int i = 0; i < PER; i++) {
      score += qv[i] * static_cast<float>(kj[i]);
    }
    for (int o = 16; o > 0; o /= 2) {
      score += __shfl_xor_sync(0xffffffff, score, o);
    }
    const float m_new = fmaxf(m, score);
    const float kept = __expf(m - m_new);
    const float p = __expf(score - m_new);
    l = l * kept + p;
    const T* vj = vp + j * v_strides[2];
    for (int i = 0; i < PER; i++) {
      acc[i] = acc[i] * kept + p * static_cast<float>(vj[i]);
    }
    m = m_new;
  }
  __shared__ float warp_m[WARPS];
  __shared__ float warp_l[WARPS];
  __shared__ float warp_acc[WARPS][D];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
  for (int i = 0; i < PER; i++) {
    warp_acc[warp][lane * PER + i] = acc[i];
  }
  __syncthreads();
  if (warp == 0) {
    float top = -INFINITY;
    for (int w = 0; w < WARPS; w++) {
      top = fmaxf(top, warp_m[w]);
    }
    float total = 0.0f;
    float o[PER];
    for (int i = 0; i < PER; i++) {
      o[i] = 0.0f;
    }
    for (int w = 0; w < WARPS; w++) {
      const float c = warp_m[w] == -INFINITY ? 0.0f : __expf(warp_m[w] - top);
      total += warp_l[w] * c;
      for (int i = 0; i < PER; i++) {
        o[i] += warp_acc[w][lane * PER + i] * c;
      }
    }
    T* op = out + ((size_t)row * heads + head) * D + lane * PER;
    for (int i = 0; i < PER; i++) {
      op[i] = static_cast<T>(o[i] / total);
    }
  }
)per_head";

// The most query heads a per-key/value-head block serves (its registers).
constexpr int kMaxGqaPerBlock = 8;

const char* kPerKvHeadSource = R"per_kv_head(
  constexpr int WARPS = 8;
  constexpr int PER = D / 32;
  const int kv_head = blockIdx.x;
  const int row = blockIdx.y;
  const int kv_heads = gridDim.x;
  const int heads = kv_heads * GQA;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int last = end[0];
  const int first = starts[row];
  const float s = scale[0];
  if (WRITE) {
    if (warp == 0) {
      write_column<PER>(k, v, k_strides, v_strides, k_new, v_new, row, kv_head, kv_heads, last, lane);
    }
    __syncthreads();
  }
  float qv[GQA][PER];
  for (int g = 0; g < GQA; g++) {
    const T* qp = q + ((size_t)row * heads + kv_head * GQA + g) * D + lane * PER;
    for (int i = 0; i < PER; i++) {
      qv[g][i] = static_cast<float>(qp[i]) * s;
    }
  }
  const T* kp = k + row * k_strides[0] + kv_head * k_strides[1] + lane * PER;
  const T* vp = v + row * v_strides[0] + kv_head * v_strides[1] + lane * PER;
  float m[GQA];
  float l[GQA];
  float acc[GQA][PER];
  for (int g = 0; g < GQA; g++) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int i = 0; i < PER; i++) {
      acc[g][i] = 0.0f;
    }
  }
  for (int j = first + warp; j <= last; j += WARPS) {
    const T* kj = kp + j * k_strides[2];
    const T* vj = vp + j * v_strides[2];
    float kf[PER];
    float vf[PER];
    for (int i = 0; i < PER; i++) {
      kf[i] = static_cast<float>(kj[i]);
      vf[i] = static_cast<float>(vj[i]);
    }
    float score[GQA];
    for (int g = 0; g < GQA; g++) {
      score[g] = 0.0f;
      for (int i = 0; i < PER; i++) {
        score[g] += qv[g][i] * kf[i];
      }
    }
    for (int o = 16; o > 0; o /= 2) {
      for (int g = 0; g < GQA; g++) {
        score[g] += __shfl_xor_sync(0xffffffff, score[g], o);
      }
    }
    for (int g = 0; g < GQA; g++) {
      const float m_new = fmaxf(m[g], score[g]);
      const float kept = __expf(m[g] - m_new);
      const float p = __expf(score[g] - m_new);
      l[g] = l[g] * kept + p;
      for (int i = 0; i < PER; i++) {
        acc[g][i] = acc[g][i] * kept + p * vf[i];
      }
      m[g] = m_new;
    }
  }
  __shared__ float warp_m[WARPS][GQA];
  __shared__ float warp_l[WARPS][GQA];
  __shared__ float warp_acc[WARPS][D];
  if (lane == 0) {
    for (int g = 0; g < GQA; g++) {
      warp_m[warp][g] = m[g];
      warp_l[warp][g] = l[g];
    }
  }
  // One query head at a time: the warps' partial sums, merged by warp 0.
  for (int g = 0; g < GQA; g++) {
    __syncthreads();
    for (int i = 0; i < PER; i++) {
      warp_acc[warp][lane * PER + i] = acc[g][i];
    }
    __syncthreads();
    if (warp == 0) {
      float top = -INFINITY;
      for (int w = 0; w < WARPS; w++) {
        top = fmaxf(top, warp_m[w][g]);
      }
      float total = 0.0f;
      float o[PER];
      for (int i = 0; i < PER; i++) {
        o[i] = 0.0f;
      }
      for (int w = 0; w < WARPS; w++) {
        const float c = warp_m[w][g] == -INFINITY ? 0.0f : __expf(warp_m[w][g] - top);
        total += warp_l[w][g] * c;
        for (int i = 0; i < PER; i++) {
          o[i] += warp_acc[w][lane * PER + i] * c;
        }
      }
      T* op = out + ((size_t)row * heads + kv_head * GQA + g) * D + lane * PER;
      for (int i = 0; i < PER; i++) {
        op[i] = static_cast<T>(o[i] / total);
      }
    }
  }
)per_kv_head";

}  // namespace

extern "C" int mlxgate_ragged_decode_attention(
    mlx_array* res,
    const mlx_array q,
    const mlx_array k,
    const mlx_array v,
    const mlx_array starts,
    const mlx_array end,
    const mlx_array scale,
    const mlx_array k_new,
    const mlx_array v_new,
    int heads,
    const mlx_stream s,
    char* error,
    size_t error_len) {
  try {
    static const mx::fast::CustomKernelFunction per_head = mx::fast::cuda_kernel(
        "mlxgate_ragged_decode_attention", {"q", "k", "v", "starts", "end", "scale", "k_new", "v_new"},
        {"out"}, kPerHeadSource, kWriteColumnSource, /*ensure_row_contiguous=*/false);
    static const mx::fast::CustomKernelFunction per_kv_head = mx::fast::cuda_kernel(
        "mlxgate_ragged_decode_attention_gqa", {"q", "k", "v", "starts", "end", "scale", "k_new", "v_new"},
        {"out"}, kPerKvHeadSource, kWriteColumnSource, /*ensure_row_contiguous=*/false);
    const mx::array& qa = mlx_array_get_(q);
    const mx::array& ka = mlx_array_get_(k);
    const mx::array& va = mlx_array_get_(v);
    if (qa.ndim() != 2 || ka.ndim() != 4 || va.shape() != ka.shape() ||
        qa.shape(0) != ka.shape(0) || heads <= 0 || qa.shape(1) % heads != 0) {
      throw std::invalid_argument(
          "[mlxgate ragged attention] q must be [rows, heads * D] and k, v [rows, kv_heads, "
          "columns, D]");
    }
    const int rows = qa.shape(0);
    const int dim = qa.shape(1) / heads;
    const int kv_heads = ka.shape(1);
    if (dim != ka.shape(3) || dim % 32 != 0 || dim > 256 || heads % kv_heads != 0 ||
        qa.dtype() != ka.dtype() || ka.dtype() != va.dtype()) {
      throw std::invalid_argument("[mlxgate ragged attention] unsupported shapes or dtypes");
    }
    // No layout can be checked here: the inputs are lazy, and a lazy array's
    // strides are the packed ones MLX assumes, not those it runs with (a
    // check of q's once passed while q ran strided). k and v are read by
    // their runtime strides over rows, heads and columns; their last
    // dimension is packed, as the slab MLX writes them into always is. q is
    // read as packed rows, but rows sliced out of a stacked q/k/v projection
    // are `q + k + v` wide apart: MLX's `contiguous` copies q where it runs,
    // only if it is not packed.
    const mx::array packed_q = mx::contiguous(qa, false, mlx_stream_get_(s));
    // This step's key and value to write first (see the file's head), packed
    // as the body reads them; without them, q stands in (never read).
    const bool write = k_new.ctx != nullptr && v_new.ctx != nullptr;
    std::optional<mx::array> new_k, new_v;
    if (write) {
      const mx::array& kn = mlx_array_get_(k_new);
      const mx::array& vn = mlx_array_get_(v_new);
      const mx::Shape column = {rows, kv_heads, 1, dim};
      if (kn.shape() != column || vn.shape() != column || kn.dtype() != ka.dtype() ||
          vn.dtype() != ka.dtype()) {
        throw std::invalid_argument(
            "[mlxgate ragged attention] the new key and value must be [rows, kv_heads, 1, D] "
            "in the slab's dtype");
      }
      new_k = mx::contiguous(kn, false, mlx_stream_get_(s));
      new_v = mx::contiguous(vn, false, mlx_stream_get_(s));
    }
    const int gqa = heads / kv_heads;
    const bool by_kv_head = gqa <= kMaxGqaPerBlock && rows > 1;
    const int threads = by_kv_head ? 256 : 128;
    auto outputs = (by_kv_head ? per_kv_head : per_head)(
        {packed_q, ka, va, mlx_array_get_(starts), mlx_array_get_(end), mlx_array_get_(scale),
         new_k.value_or(packed_q), new_v.value_or(packed_q)},
        {qa.shape()}, {qa.dtype()}, {threads * (by_kv_head ? kv_heads : heads), rows, 1},
        {threads, 1, 1}, {{"T", qa.dtype()}, {"D", dim}, {"GQA", gqa}, {"WRITE", write ? 1 : 0}},
        std::nullopt, false, mlx_stream_get_(s));
    mlx_array_set_(*res, outputs.at(0));
    return 0;
  } catch (std::exception& e) {
    return mlxgate::failed(e, error, error_len);
  }
}
