// What a CUDA kernel body (as MLX's `fast::cuda_kernel` takes it) needs to
// run on the CPU: one OS thread per CUDA thread, blocks one after another,
// their threads at once; `__syncthreads` as a barrier of the block; a
// warp's `__shfl_xor_sync` as an exchange between its 32 threads;
// `__shared__` arrays shared by the block's threads. Timing, memory order
// and half-precision types are not emulated (the harnesses run T = float).
// Included by the harnesses check_kernels.sh builds; BLOCK_THREADS, the block
// size, is defined on their command line.
#pragma once

#include <barrier>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

struct Dim3 {
  int x = 0, y = 0, z = 0;
};

static Dim3 blockIdx;
static Dim3 gridDim;
static thread_local Dim3 threadIdx;
static std::unique_ptr<std::barrier<>> block_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static float exchange[BLOCK_THREADS / 32][32];

static void __syncthreads() { block_barrier->arrive_and_wait(); }

static float __shfl_xor_sync(unsigned, float value, int mask) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  exchange[warp][lane] = value;
  warp_barriers[warp]->arrive_and_wait();
  const float other = exchange[warp][lane ^ mask];
  warp_barriers[warp]->arrive_and_wait();
  return other;
}

#define __shared__ static
#define __device__
#define __expf expf

// Runs `body` (the kernel called with its arguments) for every block of
// `gridDim` (x and y), BLOCK_THREADS threads each.
template <typename Body>
static void launch(Body body) {
  for (int by = 0; by < gridDim.y; by++) {
    for (int bx = 0; bx < gridDim.x; bx++) {
      blockIdx = {bx, by, 0};
      block_barrier = std::make_unique<std::barrier<>>(BLOCK_THREADS);
      warp_barriers.clear();
      for (int w = 0; w < BLOCK_THREADS / 32; w++) {
        warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
      }
      std::vector<std::thread> workers;
      for (int t = 0; t < BLOCK_THREADS; t++) {
        workers.emplace_back([&, t] {
          threadIdx = {t, 0, 0};
          body();
        });
      }
      for (auto& worker : workers) worker.join();
    }
  }
}
