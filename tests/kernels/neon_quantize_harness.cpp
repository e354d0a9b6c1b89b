// quantize_run (models/quantization/cpu_quantize_run.h) on Arm behind one entry point,
// built for aarch64 as a static program without a C runtime and called in an emulator by
// tests/kernels/test_neon_strips.py: `runs` runs of x (float32, bf16 or fp16) to q and d.
#include <cstdint>

#include "cpu_quantize_run.h"

struct Call {
  int64_t dtype, runs;  // dtype: 0 float32, 1 bf16, 2 fp16
  const void* x;
  int8_t* q;
  float* d;
};

template <typename T>
void quantize(const Call& c) {
  const T* x = static_cast<const T*>(c.x);
  for (int64_t r = 0; r < c.runs; ++r)
    c.d[r] = splitserve::quant::quantize_run(x + 32 * r, c.q + 32 * r);
}

extern "C" void harness(const Call* call) {
  if (call->dtype == 0) return quantize<float>(*call);
  if (call->dtype == 1) return quantize<c10::BFloat16>(*call);
  return quantize<c10::Half>(*call);
}
