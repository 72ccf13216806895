// What mlxgate's CPU kernels share: the CPU feature check, AVX2 helpers and
// the thread pool. Included by every kernel file; the pool is one object per
// process (an inline function's static), whichever file reaches it first.
#ifndef MLXGATE_KERNELS_COMMON_H
#define MLXGATE_KERNELS_COMMON_H

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXGATE_X86 1
#endif

namespace mlxgate {

inline bool cpu_supported() {
#if defined(MLXGATE_X86)
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

#if defined(MLXGATE_X86)

/// Compiles one function for AVX2 + FMA (+ F16C, which every AVX2 CPU has);
/// the library itself stays baseline x86-64 and callers check
/// `cpu_supported()` first.
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/// Compiles one function for AVX-512 (F, BW and VL: every AVX-512 CPU since
/// Skylake-SP) as well; chosen at run time, where `avx512_supported()`.
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

inline bool avx512_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// e^x for x <= 0 (attention scores minus their maximum; -|x| in SiLU), 8
/// at a time: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a degree-7
/// polynomial (relative error about 1e-7, like MLX's own vectorized exp),
/// times 2^n built in the exponent.
AVX2 inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below: e^x is ~0 in f32
  const __m256 n = _mm256_round_ps(
      _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts, so r keeps its low bits.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

#endif  // MLXGATE_X86

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

}  // namespace mlxgate

#endif
