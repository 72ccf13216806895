// Operands that are views (transposed, sliced, broadcast) gathered into a
// packed copy before the product; weights loaded from files are already
// packed.
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_PACK_H
#define MLXGATE_QMM_PACK_H

namespace {

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

}  // namespace

#endif  // MLXGATE_QMM_PACK_H
