// Choosing a loop for a product (instruction set, layout, batch size) and
// running a product, or several as one job, across the kernel thread pool
// in chunks of rows.
//
// A fragment of quantized_matmul.cpp, not a standalone header: that file
// includes the qmm_*.h fragments once each, in order, after its own
// includes, so the kernels stay one translation unit and inline as before.
#ifndef MLXGATE_QMM_DISPATCH_H
#define MLXGATE_QMM_DISPATCH_H

namespace {

#if defined(MLXGATE_X86)

template <class L>
void rows_for(const Product& p, int64_t n0, int64_t n1) {
  // AVX-512 where the CPU has it: batch 1, and decode batches with the
  // same per-input arithmetic (a sequence's logits do not depend on its
  // batch).
  const bool wide = p.m <= kMaxWideBatch && avx512_supported();
  if constexpr (L::kSplit) {
    if (wide && p.group_size == 32 && p.k / 32 <= kMaxWideGroups) {
      return p.m == 1 ? split_rows_wide<L>(p, n0, n1) : split_rows_wide_many<L>(p, n0, n1);
    }
  }
  if constexpr (L::kSigned) {
    if (wide) {
      if constexpr (L::kHalves) {
        return p.m == 1 ? signed_rows_wide<L, 16>(p, n0, n1)
                        : signed_rows_wide_many<L, 16>(p, n0, n1);
      } else {
        if (p.group_size == 32) {
          return p.m == 1 ? signed_rows_wide<L, 32>(p, n0, n1)
                          : signed_rows_wide_many<L, 32>(p, n0, n1);
        }
        if (p.m == 1) {
          return signed_rows_wide<L, 0>(p, n0, n1);
        }
      }
    }
  }
  switch (p.m) {
    case 1:
      return small_batch_rows<L, 1>(p, n0, n1);
    case 2:
      return small_batch_rows<L, 2>(p, n0, n1);
    case 3:
      return small_batch_rows<L, 3>(p, n0, n1);
    case 4:
      return small_batch_rows<L, 4>(p, n0, n1);
    default:
      return large_batch_rows<L>(p, n0, n1);
  }
}

/// Picks the instantiation for this product's storage.
template <int BITS, bool SPLIT, bool HALVES = false>
void rows_for_layout(const Product& p, int64_t n0, int64_t n1) {
  const bool derived = p.biases == nullptr;
  if (p.f16) {
    return derived ? rows_for<Layout<BITS, SPLIT, true, true, HALVES>>(p, n0, n1)
                   : rows_for<Layout<BITS, SPLIT, true, false, HALVES>>(p, n0, n1);
  }
  return derived ? rows_for<Layout<BITS, SPLIT, false, true, HALVES>>(p, n0, n1)
                 : rows_for<Layout<BITS, SPLIT, false, false, HALVES>>(p, n0, n1);
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
  switch (p.bits) {
    case 4:
      return p.split ? rows_for_layout<4, true>(p, n0, n1)
                     : rows_for_layout<4, false>(p, n0, n1);
    case 5:
      return p.f16 ? five_bit_rows<true>(p, n0, n1) : five_bit_rows<false>(p, n0, n1);
    default:
      return p.group_size == 16 ? rows_for_layout<8, false, true>(p, n0, n1)
                                : rows_for_layout<8, false>(p, n0, n1);
  }
#else
  (void)ctx;
  (void)chunk;
#endif
}

/// Several products as one job: chunk numbers run through each product's
/// chunks in turn.
struct ChunkedMany {
  std::vector<Product> products;
  std::vector<int64_t> rows;  // rows per chunk of each product
  std::vector<int64_t> first_chunk;  // of each product, plus the total
};

void run_many_chunk(const void* ctx, int64_t chunk) {
  const ChunkedMany& c = *static_cast<const ChunkedMany*>(ctx);
  size_t i = 0;
  while (chunk >= c.first_chunk[i + 1]) {
    ++i;
  }
  const Chunked one{&c.products[i], c.rows[i]};
  run_chunk(&one, chunk - c.first_chunk[i]);
}

void run_product(const Product& p) {
  const Chunked chunked{&p, rows_per_chunk(p, Pool::instance().threads())};
  Pool::instance().run(run_chunk, &chunked, (p.n + chunked.rows - 1) / chunked.rows);
}

}  // namespace

#endif  // MLXGATE_QMM_DISPATCH_H
