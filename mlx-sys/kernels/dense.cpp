// A float32 dense layer, `y = x W^T + b`, as an MLX primitive, for the
// encoder (embeddings): x `[M, K]` times W packed at load into panels of 32
// output columns (`[N / 32, K, 32]`, each panel's rows contiguous).
//
// Why: through MLX the product is an OpenBLAS sgemm that packs the weight
// again on every call (~18% of an encoder batch's time at ~100 tokens) and
// hands work to OpenBLAS's own threads, whose idle spinning competes with
// the kernel pool's attention and GELU. Packed once, the weight streams
// straight into an 8 x 32 register tile (16 AVX-512 accumulators, the bias
// as their start), and tiles spread over the kernel pool.

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels_common.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/c/private/array.h"
#include "mlxgate_kernels.h"
#include "primitive_support.h"

namespace mx = mlx::core;

namespace {

constexpr int64_t kPanel = 32;     // output columns per packed panel
constexpr int64_t kTileRows = 8;   // rows of x per register tile
constexpr int64_t kChunkRows = 64; // rows of x per chunk of work (one panel)

struct Dense {
  const float* x;       // [M, K], rows contiguous
  const float* panels;  // [N / 32, K, 32]
  const float* bias;    // [N]
  float* out;           // [M, N]
  int64_t m, k, n;
};

#if defined(MLXGATE_X86)
using mlxgate::avx512_supported;

/// R rows of x times one panel, plus the bias, into out.
template <int R>
AVX512 void tile(const Dense& d, int64_t row, const float* panel, int64_t col) {
  __m512 c0[R], c1[R];
  const __m512 b0 = _mm512_loadu_ps(d.bias + col);
  const __m512 b1 = _mm512_loadu_ps(d.bias + col + 16);
  for (int r = 0; r < R; ++r) {
    c0[r] = b0;
    c1[r] = b1;
  }
  const float* x = d.x + row * d.k;
  for (int64_t i = 0; i < d.k; ++i) {
    const __m512 w0 = _mm512_loadu_ps(panel + i * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + i * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * d.k + i]);
      c0[r] = _mm512_fmadd_ps(a, w0, c0[r]);
      c1[r] = _mm512_fmadd_ps(a, w1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = d.out + (row + r) * d.n + col;
    _mm512_storeu_ps(y, c0[r]);
    _mm512_storeu_ps(y + 16, c1[r]);
  }
}

using TileFn = void (*)(const Dense&, int64_t, const float*, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr,  tile<1>, tile<2>, tile<3>, tile<4>,
                                          tile<5>,  tile<6>, tile<7>, tile<8>};

/// One chunk: up to kChunkRows rows of x against one panel, so the panel
/// stays in cache while the rows pass.
AVX512 void dense_chunk(const void* ctx, int64_t chunk) {
  const Dense& d = *static_cast<const Dense*>(ctx);
  const int64_t panels = d.n / kPanel;
  const int64_t p = chunk % panels;
  const int64_t first = (chunk / panels) * kChunkRows;
  const int64_t last = std::min(d.m, first + kChunkRows);
  const float* panel = d.panels + p * d.k * kPanel;
  for (int64_t row = first; row < last; row += kTileRows) {
    kTiles[std::min(kTileRows, last - row)](d, row, panel, p * kPanel);
  }
}
#endif

class DenseOp : public mx::UnaryPrimitive {
 public:
  explicit DenseOp(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = mlxgate::begin_eval(stream(), inputs, out);
    const mx::array& x = inputs[0];
    const mx::array& panels = inputs[1];
    const Dense d{x.data<float>(), panels.data<float>(), inputs[2].data<float>(),
                  out.data<float>(), x.shape(0), x.shape(1), panels.shape(0) * kPanel};
    encoder.dispatch([d]() {
#if defined(MLXGATE_X86)
      const int64_t row_chunks = (d.m + kChunkRows - 1) / kChunkRows;
      mlxgate::Pool::instance().run(dense_chunk, &d, row_chunks * (d.n / kPanel));
#endif
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxgate's dense layer is a CPU kernel; use MLX's ops on GPUs");
  }

  const char* name() const override {
    return "MlxgateDense";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const DenseOp*>(&other) != nullptr;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(0) * static_cast<int>(kPanel)}};
  }
};

}  // namespace

extern "C" int mlxgate_dense_supported(void) {
#if defined(MLXGATE_X86)
  return avx512_supported() ? 1 : 0;
#else
  return 0;
#endif
}

extern "C" int mlxgate_dense(
    mlx_array* res,
    const mlx_array x,
    const mlx_array panels,
    const mlx_array bias,
    const mlx_stream s,
    char* error,
    size_t error_len) {
  try {
    if (mlxgate_dense_supported() != 1) {
      throw std::runtime_error("[mlxgate dense] this CPU lacks AVX-512; use MLX's matmul");
    }
    const mx::array& xa = mlx_array_get_(x);
    const mx::array& pa = mlx_array_get_(panels);
    const mx::array& ba = mlx_array_get_(bias);
    auto fail = [](const std::string& what) {
      throw std::invalid_argument("[mlxgate dense] " + what);
    };
    if (xa.dtype() != mx::float32 || pa.dtype() != mx::float32 || ba.dtype() != mx::float32) {
      fail("x, panels and bias must be float32");
    }
    if (xa.ndim() != 2 || pa.ndim() != 3 || pa.shape(2) != kPanel || pa.shape(1) != xa.shape(1)) {
      fail("x must be [M, K] and panels [N / 32, K, 32]");
    }
    if (ba.ndim() != 1 || ba.shape(0) != pa.shape(0) * kPanel) {
      fail("bias must be [N]");
    }
    const mx::Stream& stream = mlxgate::cpu_stream(s, "[mlxgate dense]");
    mx::Shape shape{xa.shape(0), pa.shape(0) * static_cast<int>(kPanel)};
    mlx_array_set_(*res, mx::array(std::move(shape), mx::float32, std::make_shared<DenseOp>(stream),
                                   {mx::contiguous(xa, false, stream),
                                    mx::contiguous(pa, false, stream),
                                    mx::contiguous(ba, false, stream)}));
    return 0;
  } catch (std::exception& e) {
    return mlxgate::failed(e, error, error_len);
  }
}
