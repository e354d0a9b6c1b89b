// The dense kernel's register tiles (models/layers/cpu_dense_tiles.h) built for Arm behind
// one entry point, as a static program without a C runtime, called in an emulator by
// tests/kernels/test_neon_dense.py. `call` is a Call as that test packs it.
#include <cstdint>

#include "cpu_dense_tiles.h"

struct Call {
  int64_t gemm, bf16, rows, k;  // gemm: gemm_tile on a panel; else dot_tile of 3 features
  const void* w;                // a panel [K][16], or 3 weight rows w_stride apart
  int64_t w_stride;
  const float *x, *bias;  // x [rows][K]; bias (gemm; may be null)
  float* out;             // gemm [rows][16]; dot [rows][3]
};

template <int R, typename W>
void run(const Call& c) {
  const W* w = static_cast<const W*>(c.w);
  if (c.gemm)
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
  return call->bf16 ? by_rows<uint16_t>(*call) : by_rows<float>(*call);
}
