// The dense kernel's register tiles (models/layers/cpu_dense_tiles.h) and the MoE kernel's
// dot blocks (dot_tiles.h) built for Arm behind one entry point, as a static program
// without a C runtime, called in an emulator by tests/kernels/test_neon_dense.py. `call` is
// a Call as that test packs it.
#include <cstdint>

#include "cpu_dense_tiles.h"
#include "dot_tiles.h"

struct Call {
  int64_t op, bf16, rows, k;  // op 0: dot_tile of 3 features, 1: gemm_tile, 2: dot_block
  const void* w;              // a panel [K][16], or weight rows w_stride apart
  int64_t w_stride;
  const float *x, *bias;  // x [rows][K]; bias (gemm; may be null)
  float* out;             // dot [rows][3], gemm [rows][16], dot_block [rows][cols]
  int64_t cols;           // dot_block: weight rows
  float* packed;          // dot_block: x's rows packed, [rows][K]
};

// The MoE kernel's way: x's rows packed (pack_row), then one dot_block.
template <typename W>
void run_block(const Call& c) {
  for (int64_t r = 0; r < c.rows; ++r)
    splitserve::dot::pack_row<W>(c.x + r * c.k, c.k, c.packed + r * c.k);
  splitserve::dot::dot_block(c.packed, c.k, c.rows, static_cast<const W*>(c.w), c.w_stride, c.cols,
                             c.k, c.out, c.cols);
}

template <int R, typename W>
void run(const Call& c) {
  const W* w = static_cast<const W*>(c.w);
  if (c.op == 1)
    gemm_tile<R, W>(c.x, c.k, w, c.bias, c.out, kGemmCols, Prefetch{});
  else if constexpr (R <= Vec::kRows)
    dot_tile<Vec::kFeatures, R, W>(w, c.w_stride, c.x, c.k, c.k, c.out);
}

template <typename W>
void by_rows(const Call& c) {
  static_assert(Vec::kGemmTileRows == 6 && Vec::kRows == 4 && Vec::kFeatures == 3);
  switch (c.rows) {
    case 1: return run<1, W>(c);
    case 2: return run<2, W>(c);
    case 3: return run<3, W>(c);
    case 4: return run<4, W>(c);
    case 5: return run<5, W>(c);
    default: return run<6, W>(c);
  }
}

extern "C" void harness(const Call* call) {
  if (call->op == 2) return call->bf16 ? run_block<uint16_t>(*call) : run_block<float>(*call);
  return call->bf16 ? by_rows<uint16_t>(*call) : by_rows<float>(*call);
}
