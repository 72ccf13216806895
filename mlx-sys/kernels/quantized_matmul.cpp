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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <sched.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXGATE_X86 1
#endif

namespace mx = mlx::core;

namespace {

// ---------------------------------------------------------------------------
// Thread pool. A job is a range of chunks that threads claim one at a time:
// the stream thread starts claiming at once and workers join as they wake,
// so a worker descheduled by the OS (2 cores shared with the engine thread)
// delays the job by at most the chunk it holds, never by a whole share.
// Workers spin briefly between jobs (a token's matmuls come tens of
// microseconds apart), then yield, then sleep on a condition variable.

using ChunkFn = void (*)(const void* ctx, int64_t chunk);

class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool();  // never destroyed: workers outlive main
    return *pool;
  }

  int threads() const {
    return threads_.load(std::memory_order_relaxed);
  }

  int set_threads(int threads) {
    if (threads <= 0) {
      threads = cores();
    }
    threads = std::clamp(threads, 1, 64);
    std::lock_guard<std::mutex> lock(busy_);
    stop_workers();
    // Each worker starts from the epoch at its creation: one that read it
    // itself could start after a later post and miss it.
    const uint32_t start = epoch_.load(std::memory_order_seq_cst);
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this, start] { work(start); });
    }
    threads_.store(threads, std::memory_order_relaxed);
    return threads;
  }

  /// Runs `fn(ctx, chunk)` for every chunk in [0, chunks); returns when all
  /// are done. A second caller while a job runs (several MLX streams at
  /// once) does its job alone rather than wait.
  void run(ChunkFn fn, const void* ctx, int64_t chunks) {
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock() || workers_.empty() || chunks <= 1) {
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        fn(ctx, chunk);
      }
      return;
    }
    fn_ = fn;
    ctx_ = ctx;
    chunks_ = chunks;
    done_.store(0, std::memory_order_relaxed);
    next_.store(0, std::memory_order_relaxed);
    open_.store(true, std::memory_order_seq_cst);
    post();
    claim_all();
    // Chunks claimed by workers may still be running.
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      relax(spins);
    }
    // Close the job, then wait out workers that entered it: a worker
    // announces itself (active_) before it checks open_, so either it sees
    // the job closed or this sees it active. None may touch the job's
    // fields once this returns.
    open_.store(false, std::memory_order_seq_cst);
    for (int spins = 0; active_.load(std::memory_order_seq_cst) != 0; ++spins) {
      relax(spins);
    }
  }

 private:
  Pool() {
    const char* env = std::getenv("MLXGATE_KERNEL_THREADS");
    set_threads(env ? std::atoi(env) : 0);
  }

  static int cores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      return std::max(1, CPU_COUNT(&set));
    }
    return std::max(1u, std::thread::hardware_concurrency());
  }

  /// Busy-waits politely: pause first, then give the core away.
  static void relax(int spins) {
#if defined(MLXGATE_X86)
    if (spins < 256) {
      _mm_pause();
      return;
    }
#endif
    std::this_thread::yield();
  }

  void claim_all() {
    for (;;) {
      const int64_t chunk = next_.fetch_add(1, std::memory_order_acq_rel);
      if (chunk >= chunks_) {
        return;
      }
      fn_(ctx_, chunk);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void work(uint32_t seen) {
    for (;;) {
      auto deadline =
          std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      uint32_t now = epoch_.load(std::memory_order_acquire);
      for (int spins = 0; now == seen; ++spins) {
        relax(spins);
        if ((spins & 31) == 31 && std::chrono::steady_clock::now() > deadline) {
          sleep_until_posted(seen);
          deadline = std::chrono::steady_clock::now() +
              std::chrono::microseconds(200);
          spins = 0;
        }
        now = epoch_.load(std::memory_order_acquire);
      }
      seen = now;
      if (stopping_.load(std::memory_order_acquire)) {
        return;
      }
      // Announce before looking at the job (see `run`).
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst)) {
        claim_all();
      }
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  /// Publishes a new epoch and wakes sleeping workers. The epoch bump and
  /// the sleeper count are sequentially consistent on both sides, so either
  /// the poster sees the sleeper or the sleeper sees the new epoch.
  void post() {
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
  }

  /// Sleeps until the epoch moves past `seen` (a condition variable rather
  /// than `std::atomic::wait`, which loses wake-ups in GCC 12's libstdc++).
  void sleep_until_posted(uint32_t seen) {
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lock, [&] {
      return epoch_.load(std::memory_order_seq_cst) != seen;
    });
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  void stop_workers() {
    if (workers_.empty()) {
      return;
    }
    stopping_.store(true, std::memory_order_release);
    post();
    for (auto& worker : workers_) {
      worker.join();
    }
    workers_.clear();
    stopping_.store(false, std::memory_order_release);
  }

  std::mutex busy_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> active_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<int> threads_{1};
  ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t chunks_ = 0;
};

// ---------------------------------------------------------------------------
// Kernels.

/// One product `y[M, N] = x[M, K] @ W^T`, W affine-quantized by rows.
struct Product {
  const float* x;
  const uint8_t* w;  // N rows of K * bits / 8 bytes
  const float* scales;  // [N, K / group_size]
  const float* biases;
  float* y;
  int64_t m, n, k;
  int group_size, bits;
};

bool cpu_supported() {
#if defined(MLXGATE_X86)
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

#if defined(MLXGATE_X86)

#define AVX2 __attribute__((target("avx2,fma")))

/// 32 weight codes starting at `p` as four vectors of 8 floats, in order.
template <int BITS>
AVX2 inline void load_codes(const uint8_t* p, __m256 q[4]) {
  if constexpr (BITS == 4) {
    // Byte j holds code 2j in its low nibble and code 2j+1 in its high one.
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i first = _mm_unpacklo_epi8(lo, hi);
    const __m128i second = _mm_unpackhi_epi8(lo, hi);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
  } else {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes =
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    }
  }
}

AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// Decode and small batches: rows [n0, n1) against all M (<= 4) inputs,
/// dequantizing each 32-weight chunk in registers as it streams past.
template <int BITS, int M>
AVX2 void small_batch_rows(const Product& p, int64_t n0, int64_t n1) {
  constexpr int64_t kChunkBytes = 32 * BITS / 8;
  const int64_t row_bytes = p.k * BITS / 8;
  const int64_t groups = p.k / p.group_size;
  const int64_t chunks_per_group = p.group_size / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * row_bytes;
    const float* scales = p.scales + n * groups;
    const float* biases = p.biases + n * groups;
    _mm_prefetch(reinterpret_cast<const char*>(w + row_bytes), _MM_HINT_T0);
    __m256 acc[M][2];
    for (int m = 0; m < M; ++m) {
      acc[m][0] = _mm256_setzero_ps();
      acc[m][1] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 scale = _mm256_broadcast_ss(scales + g);
      const __m256 bias = _mm256_broadcast_ss(biases + g);
      for (int64_t c = 0; c < chunks_per_group; ++c) {
        const int64_t k = (g * chunks_per_group + c) * 32;
        const uint8_t* chunk = w + k * BITS / 8;
        _mm_prefetch(reinterpret_cast<const char*>(chunk + 4 * kChunkBytes),
                     _MM_HINT_T0);
        __m256 q[4];
        load_codes<BITS>(chunk, q);
        for (int i = 0; i < 4; ++i) {
          const __m256 weight = _mm256_fmadd_ps(q[i], scale, bias);
          for (int m = 0; m < M; ++m) {
            const __m256 xv = _mm256_loadu_ps(p.x + m * p.k + k + 8 * i);
            acc[m][i & 1] = _mm256_fmadd_ps(weight, xv, acc[m][i & 1]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      p.y[m * p.n + n] = horizontal_sum(_mm256_add_ps(acc[m][0], acc[m][1]));
    }
  }
}

/// Dequantizes rows [n, n + rows) into `out` (rows x K floats).
template <int BITS>
AVX2 void dequantize_rows(const Product& p, int64_t n, int rows, float* out) {
  const int64_t row_bytes = p.k * BITS / 8;
  const int64_t groups = p.k / p.group_size;
  const int64_t chunks_per_group = p.group_size / 32;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* w = p.w + (n + r) * row_bytes;
    const float* scales = p.scales + (n + r) * groups;
    const float* biases = p.biases + (n + r) * groups;
    float* dst = out + r * p.k;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 scale = _mm256_broadcast_ss(scales + g);
      const __m256 bias = _mm256_broadcast_ss(biases + g);
      for (int64_t c = 0; c < chunks_per_group; ++c) {
        const int64_t k = (g * chunks_per_group + c) * 32;
        __m256 q[4];
        load_codes<BITS>(w + k * BITS / 8, q);
        for (int i = 0; i < 4; ++i) {
          _mm256_store_ps(dst + k + 8 * i, _mm256_fmadd_ps(q[i], scale, bias));
        }
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
template <int BITS>
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
      dequantize_rows<BITS>(p, n, kRows, rows);
      int64_t m = m0;
      for (; m + kCols <= m1; m += kCols) {
        tile<kRows, kCols>(p, rows, n, m);
      }
      for (; m < m1; ++m) {
        tile<kRows, 1>(p, rows, n, m);
      }
    }
    for (; n < n1; ++n) {
      dequantize_rows<BITS>(p, n, 1, rows);
      for (int64_t m = m0; m < m1; ++m) {
        tile<1, 1>(p, rows, n, m);
      }
    }
  }
  std::free(rows);
}

template <int BITS>
void rows_for(const Product& p, int64_t n0, int64_t n1) {
  switch (p.m) {
    case 1:
      return small_batch_rows<BITS, 1>(p, n0, n1);
    case 2:
      return small_batch_rows<BITS, 2>(p, n0, n1);
    case 3:
      return small_batch_rows<BITS, 3>(p, n0, n1);
    case 4:
      return small_batch_rows<BITS, 4>(p, n0, n1);
    default:
      return large_batch_rows<BITS>(p, n0, n1);
  }
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
  if (p.bits == 4) {
    rows_for<4>(p, n0, n1);
  } else {
    rows_for<8>(p, n0, n1);
  }
#else
  (void)ctx;
  (void)chunk;
#endif
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
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    Packed packed[4];
    for (int i = 0; i < 4; ++i) {
      packed[i] = pack(inputs[i], encoder);
      encoder.set_input_array(inputs[i]);
    }
    encoder.set_output_array(out);
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
          static_cast<const float*>(packed_data(packed_s)),
          static_cast<const float*>(packed_data(packed_b)),
          y, m, n, k, group_size, bits};
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
      grads.push_back(mx::quantized_matmul(
          cotangents[0], primals[1], primals[2], primals[3],
          /*transpose=*/false, group_size_, bits_, "affine", stream()));
    }
    return grads;
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
  if (group_size <= 0 || group_size % 32 != 0) {
    fail("group size must be a multiple of 32, got " + std::to_string(group_size));
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
  if (static_cast<int64_t>(w.shape(1)) * 32 / bits != k || k % group_size != 0) {
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
    const mx::Stream& stream = mlx_stream_get_(s);
    if (stream.device != mx::Device::cpu) {
      throw std::invalid_argument(
          "[mlxgate quantized matmul] runs on CPU streams only");
    }
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
    if (error && error_len) {
      std::snprintf(error, error_len, "%s", e.what());
    }
    return 1;
  }
}
