// One run of kRun activations quantized to int8, as every int8 kernel reads them:
// d = max|x| / 127, q = round(x / d) to even (as torch.round), within +-127. The AVX2 and
// NEON paths do the scalar path's float operations in vectors, so all three give the same
// bytes and scale (gcc 12 left the scalar loop's max scalar: ~1 cycle a value, 5 % of a
// Q4_1 batch's time on AVX2). No torch headers but c10's number types:
// tests/kernels/test_neon_strips.py builds the NEON path for aarch64 and runs it in an
// emulator.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_quant_layout.h"
#include "cpu_vec8.h"

namespace splitserve::quant {

template <typename T>
float quantize_run(const T* x, int8_t* q) {
  static_assert(kRun == 32);
#if defined(SPLITSERVE_AVX2)
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = widen8(x + 8 * i);  // max(|v|, amax): amax where v is NaN, as std::max
    amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]), amax);
  }
  const float d = max_lanes(amax) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n[i] = _mm256_cvtps_epi32(
        _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
  }
  // The packs work within 128-bit halves: dwords 0-3 hold values 0-3 of n[0..3], dwords
  // 4-7 their values 4-7; the permutation puts each n[i]'s two dwords side by side.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                           _mm256_packs_epi32(n[2], n[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  return d;
#elif defined(SPLITSERVE_NEON)
  // maxnm/minnm ignore a NaN operand as AVX2's max/min with the NaN first do (a NaN x
  // counts 0 in the max and becomes -127).
  V8 v[4];
  float32x4_t amax = vdupq_n_f32(0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = widen8(x + 8 * i);
    amax = vmaxnmq_f32(vabsq_f32(v[i].hi), vmaxnmq_f32(vabsq_f32(v[i].lo), amax));
  }
  const float d = vmaxvq_f32(amax) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
  const auto to_int = [&](float32x4_t vi) {
    const float32x4_t r = vrndnq_f32(vmulq_f32(vi, vdupq_n_f32(inv)));
    return vqmovn_s32(
        vcvtq_s32_f32(vminnmq_f32(vmaxnmq_f32(r, vdupq_n_f32(-127.0f)), vdupq_n_f32(127.0f))));
  };
  int8x8_t n[4];
  for (int i = 0; i < 4; ++i) n[i] = vqmovn_s16(vcombine_s16(to_int(v[i].lo), to_int(v[i].hi)));
  vst1q_s8(q, vcombine_s8(n[0], n[1]));
  vst1q_s8(q + 16, vcombine_s8(n[2], n[3]));
  return d;
#else
  float v[kRun], amax = 0.0f;
  for (int64_t i = 0; i < kRun; ++i) {
    v[i] = static_cast<float>(x[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
  for (int64_t i = 0; i < kRun; ++i)
    q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i] * inv), -127.0f, 127.0f));
  return d;
#endif
}

}  // namespace splitserve::quant
