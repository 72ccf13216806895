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
//
// The file is one translation unit in parts, included below in this order:
//   qmm_product.h       the product every loop takes, accepted group sizes
//   qmm_avx2.h          AVX2 decode and small-batch loops (M <= 4)
//   qmm_avx512.h        AVX-512 batch-1 loops (signed 8-bit, split 4-bit)
//   qmm_avx512_batch.h  AVX-512 decode-batch loops, per input as batch 1
//   qmm_five_bit.h      five-bit codes and their AVX-512 loops
//   qmm_avx2_prefill.h  AVX2 prefill and large-batch loops (M > 4)
//   qmm_dispatch.h      picking a loop, running products on the pool
//   qmm_pack.h          gathering view operands into packed copies
//   qmm_primitive.h     the MLX primitive and its operand checks
// followed here by the C ABI (`mlxgate_kernels.h`). One translation unit
// keeps inlining and code generation as they were when this was one file.

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

#include "qmm_product.h"
#include "qmm_avx2.h"
#include "qmm_avx512.h"
#include "qmm_avx512_batch.h"
#include "qmm_five_bit.h"
#include "qmm_avx2_prefill.h"
#include "qmm_dispatch.h"
#include "qmm_pack.h"
#include "qmm_primitive.h"

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
