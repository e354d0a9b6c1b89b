// Eight float32 lanes, the vector that paths built for both AVX2 and Arm are written on
// (attention/backends/cpu_attn_vec8.h, models/quantization/cpu_quant_strips_neon.h): an
// __m256 on AVX2 builds, two float32x4_t on Arm (lanes 0-3, 4-7). Each Arm operation
// rounds, and sums lanes in the order, as its AVX2 one does, so such a path computes
// bitwise the same on both.
#pragma once

#include "cpu_math.h"

namespace splitserve {

#if defined(SPLITSERVE_AVX2)

using V8 = __m256;
using M8 = __m256;  // a lane mask

inline V8 zero8() { return _mm256_setzero_ps(); }
inline V8 set8(float v) { return _mm256_set1_ps(v); }
inline V8 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* p, V8 v) { _mm256_storeu_ps(p, v); }
inline V8 fmadd8(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, fused
inline V8 add8(V8 a, V8 b) { return _mm256_add_ps(a, b); }
inline V8 sub8(V8 a, V8 b) { return _mm256_sub_ps(a, b); }
inline V8 mul8(V8 a, V8 b) { return _mm256_mul_ps(a, b); }
// Lanes 0 .. count - 1.
inline M8 lanes_below(int count) {
  return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(float(count)),
                       _CMP_LT_OQ);
}
inline V8 select8(M8 m, V8 yes, V8 no) { return _mm256_blendv_ps(no, yes, m); }
inline V8 max8(V8 a, V8 b) { return _mm256_max_ps(a, b); }
// Lane t of the result is the sum of the 8 lanes of v[t]: ((0 + 1) + (2 + 3)) + ((4 + 5) +
// (6 + 7)).
inline V8 sum_each8(const V8* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

#elif defined(SPLITSERVE_NEON)

struct V8 {
  float32x4_t lo, hi;
};
struct M8 {
  uint32x4_t lo, hi;
};

inline V8 zero8() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
inline V8 set8(float v) { return {vdupq_n_f32(v), vdupq_n_f32(v)}; }
inline V8 load8(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void store8(float* p, V8 v) {
  vst1q_f32(p, v.lo);
  vst1q_f32(p + 4, v.hi);
}
inline V8 fmadd8(V8 a, V8 b, V8 c) {
  return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)};
}
inline V8 add8(V8 a, V8 b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline V8 sub8(V8 a, V8 b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
inline V8 mul8(V8 a, V8 b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline M8 lanes_below(int count) {
  const uint32_t lanes[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const uint32x4_t n = vdupq_n_u32(static_cast<uint32_t>(count));
  return {vcltq_u32(vld1q_u32(lanes), n), vcltq_u32(vld1q_u32(lanes + 4), n)};
}
inline V8 select8(M8 m, V8 yes, V8 no) {
  return {vbslq_f32(m.lo, yes.lo, no.lo), vbslq_f32(m.hi, yes.hi, no.hi)};
}
inline V8 max8(V8 a, V8 b) { return {vmaxq_f32(a.lo, b.lo), vmaxq_f32(a.hi, b.hi)}; }
inline V8 sum_each8(const V8* v) {
  // Lanes 0-3 (or 4-7) of v[t0 .. t0 + 3] summed pairwise: each vector's half, in lane t.
  const auto halves = [&](int t0, float32x4_t V8::*half) {
    return vpaddq_f32(vpaddq_f32(v[t0].*half, v[t0 + 1].*half),
                      vpaddq_f32(v[t0 + 2].*half, v[t0 + 3].*half));
  };
  return {vaddq_f32(halves(0, &V8::lo), halves(0, &V8::hi)),
          vaddq_f32(halves(4, &V8::lo), halves(4, &V8::hi))};
}

// 8 consecutive float32, bf16 or fp16 values as float32 (bf16: the same shift as AVX2's).
inline V8 widen8(const float* p) { return load8(p); }
inline V8 widen8(const c10::BFloat16* p) {
  const uint16x8_t raw = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(raw), 16)),
          vreinterpretq_f32_u32(vshll_high_n_u16(raw, 16))};
}
inline V8 widen8(const c10::Half* p) {
  const float16x8_t raw = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  return {vcvt_f32_f16(vget_low_f16(raw)), vcvt_high_f32_f16(raw)};
}

inline float max_lanes(V8 v) { return vmaxvq_f32(vmaxq_f32(v.lo, v.hi)); }
// As AVX2's sum8: (0 + 4) + (2 + 6), (1 + 5) + (3 + 7), then those two.
inline float sum8(V8 v) {
  const float32x4_t s = vaddq_f32(v.lo, v.hi);
  const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
  return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

// exp_nonpositive of 8 lanes: AVX2's exp_nonpositive8, operation for operation.
inline float32x4_t exp_nonpositive4(float32x4_t y) {
  const float32x4_t limit = vdupq_n_f32(-87.0f);
  const float32x4_t yc = vmaxq_f32(y, limit);
  const float32x4_t n =
      vrndmq_f32(vfmaq_f32(vdupq_n_f32(0.5f), yc, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(yc, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), vmulq_f32(p, r), r);
  const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  const float32x4_t value = vmulq_f32(p, vreinterpretq_f32_s32(bits));
  return vbslq_f32(vcltq_f32(y, limit), vdupq_n_f32(0.0f), value);
}
inline V8 exp_nonpositive8(V8 y) { return {exp_nonpositive4(y.lo), exp_nonpositive4(y.hi)}; }

#endif

#if defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)
// The largest of s[0..n), n >= 1.
inline float max8(const float* s, int64_t n) {
  V8 lanes = set8(s[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) lanes = max8(lanes, load8(s + i));
  float max = max_lanes(lanes);
  for (; i < n; ++i) max = s[i] > max ? s[i] : max;
  return max;
}

// s[0..n) becomes exp(s - max), unnormalised; returns its sum.
inline float exp_sum8(float* s, int64_t n, float max) {
  const V8 m = set8(max);
  V8 sums = zero8();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const V8 e = exp_nonpositive8(sub8(load8(s + i), m));
    store8(s + i, e);
    sums = add8(sums, e);
  }
  float sum = sum8(sums);
  for (; i < n; ++i) sum += (s[i] = exp_nonpositive(s[i] - max));
  return sum;
}
#endif

}  // namespace splitserve
