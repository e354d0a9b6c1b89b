// The per-ISA pieces of cpu_quant_linear.cpp: reading a BlockQuantWeight's rows
// (models/quantization/block_quant.py) as float32 values or as unsigned bytes for integer
// dot products. A 32-run of a row is 16 bytes for bits=4 (byte i: element i in its low
// nibble, element i + 16 in its high one) and 32 int8 bytes for bits=8; a half is 16 of
// its elements, so every half has one scale (block sizes are multiples of 16).
#pragma once

#include <c10/util/Half.h>

#include "cpu_math.h"

#include <cstdint>

namespace splitserve::quant {

// A contiguous BlockQuantWeight's tensors as the kernels read them.
struct QuantRows {
  const uint8_t* q;
  const void* scales;  // [N, K / block_size], float16 (half) or float32
  const void* mins;    // as scales, or null
  bool half;
  int64_t K, bits, block_size;

  int64_t row_bytes() const { return bits == 4 ? K / 2 : K; }
  int64_t blocks() const { return K / block_size; }
  float scale(const void* table, int64_t i) const {
    if (!half) return static_cast<const float*>(table)[i];
    const uint16_t bits16 = static_cast<const uint16_t*>(table)[i];
#if defined(SPLITSERVE_AVX2)
    return _cvtsh_ss(bits16);
#else
    return static_cast<float>(c10::Half(bits16, c10::Half::from_bits()));
#endif
  }
};

#if defined(SPLITSERVE_AVX512)

// 16 float32 lanes.
struct F16x {
  __m512 v;
};
inline F16x zeros() { return {_mm512_setzero_ps()}; }
// The half h of a 4-bit run, as floats.
inline F16x q4_half(const uint8_t* run, int h) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
  b = _mm_and_si128(h ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F));
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))};
}
inline F16x q8_half(const uint8_t* run, int h) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16 * h));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
// q * s + m, rounded after the product and after the sum as BlockQuantWeight.dequantize.
inline F16x dequant(F16x q, float s, float m) {
  return {_mm512_add_ps(_mm512_mul_ps(q.v, _mm512_set1_ps(s)), _mm512_set1_ps(m))};
}
inline F16x fma_x(F16x w, const float* x, F16x acc) {
  return {_mm512_fmadd_ps(w.v, _mm512_loadu_ps(x), acc.v)};
}
inline F16x add(F16x a, F16x b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float sum(F16x a) { return _mm512_reduce_add_ps(a.v); }

#elif defined(SPLITSERVE_AVX2)

struct F16x {
  __m256 lo, hi;
};
inline F16x zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16x bytes_to_floats(__m128i b, bool is_signed) {
  const __m128i b_hi = _mm_srli_si128(b, 8);
  const __m256i lo = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(b_hi) : _mm256_cvtepu8_epi32(b_hi);
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
}
inline F16x q4_half(const uint8_t* run, int h) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
  return bytes_to_floats(_mm_and_si128(h ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F)), false);
}
inline F16x q8_half(const uint8_t* run, int h) {
  return bytes_to_floats(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16 * h)), true);
}
inline F16x dequant(F16x q, float s, float m) {
  const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
  return {_mm256_add_ps(_mm256_mul_ps(q.lo, vs), vm), _mm256_add_ps(_mm256_mul_ps(q.hi, vs), vm)};
}
inline F16x fma_x(F16x w, const float* x, F16x acc) {
  return {_mm256_fmadd_ps(w.lo, _mm256_loadu_ps(x), acc.lo),
          _mm256_fmadd_ps(w.hi, _mm256_loadu_ps(x + 8), acc.hi)};
}
inline F16x add(F16x a, F16x b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline float sum(F16x a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#else  // generic: plain loops the compiler may vectorise

struct F16x {
  float v[16];
};
inline F16x zeros() { return {}; }
inline F16x q4_half(const uint8_t* run, int h) {
  F16x r;
  for (int i = 0; i < 16; ++i) r.v[i] = float((run[i] >> (4 * h)) & 0x0F);
  return r;
}
inline F16x q8_half(const uint8_t* run, int h) {
  F16x r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(static_cast<int8_t>(run[16 * h + i]));
  return r;
}
inline F16x dequant(F16x q, float s, float m) {
  for (float& v : q.v) v = v * s + m;
  return q;
}
inline F16x fma_x(F16x w, const float* x, F16x acc) {
  for (int i = 0; i < 16; ++i) acc.v[i] = std::fma(w.v[i], x[i], acc.v[i]);
  return acc;
}
inline F16x add(F16x a, F16x b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline float sum(F16x a) {
  float s = 0.0f;
  for (float v : a.v) s += v;
  return s;
}

#endif

#if defined(SPLITSERVE_AVX2)

// A 32-run's integer dot product with 32 int8 activations, as 8 int32 lanes: lanes 0-3
// cover the run's first half, lanes 4-7 its second. `u` holds the weights as unsigned
// bytes: 4-bit values, or |q| for 8-bit ones, whose signs then move onto the activations.
inline __m256i q4_run(const uint8_t* run) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}
inline __m256i dot_run(__m256i u, __m256i a) {
#if defined(SPLITSERVE_AVX512_BF16)  // every CPU with AVX512-BF16 has AVX512-VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else  // |q| <= 128 and |a| <= 127: the int16 pair sums cannot saturate
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}
// The per-lane weight scales times the activation scale.
inline __m256 lane_scales(float s0, float s1, float d) {
  return _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0)), _mm256_set1_ps(d));
}
inline float sum8(__m256 s) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#endif

}  // namespace splitserve::quant
