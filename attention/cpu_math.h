// Numeric helpers shared by the C++ CPU kernels (attention/cpp_extension.py puts this
// folder on every kernel's include path).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace splitserve {

// A bfloat16's bits are the top half of a float's.
inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// exp(y) for y <= 0, Cephes' expf (relative error ~1e-7), 0 below -87 and for -inf.
// Branch-free, so the loops that call it vectorise (std::exp does not without
// -ffast-math).
inline float exp_nonpositive(float y) {
  float yc = y < -87.0f ? -87.0f : y;
  float n = std::floor(yc * 1.44269504088896341f + 0.5f);
  float r = yc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y < -87.0f ? 0.0f : p * scale;
}

}  // namespace splitserve
