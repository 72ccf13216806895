// The MLX primitive (`QuantizedMatmul`: evaluation on the CPU stream, the
// gradient with respect to x) and the checks on its operands.
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_PRIMITIVE_H
#define MLXGATE_QMM_PRIMITIVE_H

namespace {

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

#endif  // MLXGATE_QMM_PRIMITIVE_H
