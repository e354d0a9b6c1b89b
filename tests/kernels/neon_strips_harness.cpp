// The Arm strip passes (models/quantization/cpu_quant_strips_neon.h) behind one entry point,
// built for aarch64 as a static program without a C runtime and called in an emulator by
// tests/kernels/test_neon_strips.py. `call` is a Call as that test packs it: 8-byte fields.
#include <cstdint>

#include "cpu_quant_strips_neon.h"

namespace quant = splitserve::quant;
namespace neon = splitserve::quant::neon;

struct Call {
  int64_t int8, bits, whole, rows, strip, row0;  // row0: x's first row (int8: in the Acts)
  const uint8_t* q;
  const void *scales, *mins;
  int64_t half, n, k, block_size;
  const int8_t* xq;  // Acts (int8)
  const float *d, *sums;
  const int32_t* half_block;
  int64_t runs;
  const float* x;  // x float32 [rows, ldx] and its sums per half (f32)
  int64_t ldx;
  const float* xsums;
  float* res;  // [rows][8]
};

template <int Bits, bool Whole, int R>
void run_int8(const Call& c, const quant::Strips& w) {
  const quant::Acts a{c.xq, c.d, nullptr, c.sums, c.half_block, nullptr, nullptr, c.runs, 0};
  neon::strip_pass_int8<Bits, Whole, R>(w, c.strip, a, c.row0,
                                        reinterpret_cast<float (*)[quant::kStrip]>(c.res));
}

template <int Bits, int R>
void run_f32(const Call& c, const quant::Strips& w) {
  neon::strip_pass_f32<Bits, R>(w, c.strip, c.x, c.ldx, c.xsums,
                                reinterpret_cast<float (*)[quant::kStrip]>(c.res));
}

template <int Bits, bool Whole>
void by_rows(const Call& c, const quant::Strips& w) {
  static_assert(neon::kMaxStripRows == 4);
  switch (c.rows) {
    case 1: return c.int8 ? run_int8<Bits, Whole, 1>(c, w) : run_f32<Bits, 1>(c, w);
    case 2: return c.int8 ? run_int8<Bits, Whole, 2>(c, w) : run_f32<Bits, 2>(c, w);
    case 3: return c.int8 ? run_int8<Bits, Whole, 3>(c, w) : run_f32<Bits, 3>(c, w);
    default: return c.int8 ? run_int8<Bits, Whole, 4>(c, w) : run_f32<Bits, 4>(c, w);
  }
}

extern "C" void harness(const Call* call) {
  const Call& c = *call;
  const quant::Strips w{c.q, c.scales, c.mins, c.half != 0, c.n, c.k, c.bits, c.block_size};
  if (c.bits == 4) return c.whole ? by_rows<4, true>(c, w) : by_rows<4, false>(c, w);
  return c.whole ? by_rows<8, true>(c, w) : by_rows<8, false>(c, w);
}
