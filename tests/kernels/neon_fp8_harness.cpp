// The fp8 linear kernel's dot products (models/quantization/cpu_fp8_tiles.h) built for Arm
// behind one entry point, as a static program without a C runtime, called in an emulator
// by tests/kernels/test_neon_fp8.py: dots [N][M] (zeroed) of x [M][K] float32 and the e4m3
// weight [N][K], weight rows in pairs as cpu_fp8_linear.cpp takes them.
#include <cstdint>

#include "cpu_fp8_tiles.h"

namespace fp8 = splitserve::fp8;

struct Call {
  int64_t M, N, K;
  const uint8_t* w;
  const float* x;
  float* dots;
};

extern "C" void harness(const Call* call) {
  const Call& c = *call;
  for (int64_t n = 0; n < c.N; n += fp8::kWeightRows) {
    const uint8_t* w = c.w + n * c.K;
    if (c.N - n >= fp8::kWeightRows)
      fp8::dot_rows<fp8::kWeightRows>(w, c.K, c.x, c.K, c.K, c.dots + n * c.M, c.M);
    else
      fp8::dot_rows<1>(w, c.K, c.x, c.K, c.K, c.dots + n * c.M, c.M);
  }
}
