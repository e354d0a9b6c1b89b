// The fp8 (e4m3fn) linear kernel's dot products (cpu_fp8_linear.cpp): weight rows widened
// to float32 in registers and multiplied with FMA by a few rows of x. No torch headers but
// c10's number types: tests/kernels/test_neon_fp8.py builds the NEON path for aarch64 and
// runs it in an emulator.
//
// An e4m3 byte s.eeee.mmm becomes a float16 by moving its bits into place: sign to bit
// 15, exponent and mantissa to bits 13..7 (the top of float16's exponent field stays 0).
// float16's exponent bias is 15, e4m3's 7, so the float16 is the value times 2^-8,
// subnormals included (both formats' subnormals scale alike); vcvtph2ps (Arm: fcvtl)
// widens it, and the 2^8 goes into the output feature's scale. The NaN byte (0x7F, which
// no quantizer writes) reads as 480. Paths: AVX-512 (32 bytes a step), AVX2 + F16C and
// NEON (16; NEON on kernels/cpu_vec8.h's 8 lanes, summed in AVX2's order, so bitwise the
// AVX2 path's results), and a table lookup for the generic build and the tail of K.
#pragma once

#include <array>
#include <cstdint>

#include "cpu_vec8.h"

namespace splitserve::fp8 {

constexpr float kExponentShift = 256.0f;  // 2^(15 - 7): float16 vs e4m3 exponent bias

// Each byte's value times 2^-8 (what the vector paths' float16s hold): a subnormal
// (exponent 0) m * 2^-17, a normal (8 + m) * 2^(e - 18).
inline constexpr std::array<float, 256> kE4m3Table = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float unit = 1.0f / 131072.0f;  // 2^-17
    for (int i = 1; i < e; ++i) unit *= 2.0f;
    const float magnitude = static_cast<float>(e == 0 ? m : 8 + m) * unit;
    t[b] = (b & 0x80) ? -magnitude : magnitude;
  }
  return t;
}();

#if defined(SPLITSERVE_AVX512)
#define SPLITSERVE_FP8_VECTORS
struct Simd {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  // 2 * kLanes bytes -> their values times 2^-8.
  static void widen(const uint8_t* p, V& lo, V& hi) {
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(int16_t(0xBF80)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
};
#elif defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)
#define SPLITSERVE_FP8_VECTORS
struct Simd {
  using V = V8;
  static constexpr int64_t kLanes = 8;
  static V zero() { return zero8(); }
  static V load(const float* p) { return load8(p); }
  static void store(float* p, V v) { store8(p, v); }
  static V fma(V a, V b, V c) { return fmadd8(a, b, c); }
  static float sum(V a) { return sum8(a); }
  static void widen(const uint8_t* p, V& lo, V& hi) {
#if defined(SPLITSERVE_AVX2)
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(int16_t(0xBF80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
#else
    const int8x16_t bytes = vld1q_s8(reinterpret_cast<const int8_t*>(p));
    const auto half = [](int16x8_t h) -> V {
      const float16x8_t f =
          vreinterpretq_f16_s16(vandq_s16(vshlq_n_s16(h, 7), vdupq_n_s16(int16_t(0xBF80))));
      return {vcvt_f32_f16(vget_low_f16(f)), vcvt_high_f32_f16(f)};
    };
    lo = half(vmovl_s8(vget_low_s8(bytes)));
    hi = half(vmovl_high_s8(bytes));
#endif
  }
};
#endif

constexpr int kWeightRows = 2;  // weight rows converted together
// Rows of x multiplied in one pass over the weight rows: as many as leave the
// accumulators (kWeightRows per row) and the converted weights in registers.
#if defined(SPLITSERVE_AVX512)
constexpr int kRowGroup = 8;
#else
constexpr int kRowGroup = 4;
#endif

// dots[j * M + r] += sum_k x[r, k] * w_j[k] * 2^-8 over `len` input features, for the kW
// weight rows w_j (w_stride apart) and the kX rows of x (x_stride apart). One accumulator
// per (j, r): kW * kX independent FMA chains, and each x vector loaded serves kW rows.
template <int kW, int kX>
void dot_tile(const uint8_t* w, int64_t w_stride, const float* x, int64_t x_stride, int64_t len,
              float* dots, int64_t M) {
  int64_t k = 0;
#if defined(SPLITSERVE_FP8_VECTORS)
  constexpr int64_t kStep = 2 * Simd::kLanes;
  Simd::V acc[kW][kX];
  for (int j = 0; j < kW; ++j)
    for (int r = 0; r < kX; ++r) acc[j][r] = Simd::zero();
  for (; k + kStep <= len; k += kStep) {
    Simd::V lo[kW], hi[kW];
    for (int j = 0; j < kW; ++j) Simd::widen(w + j * w_stride + k, lo[j], hi[j]);
    for (int r = 0; r < kX; ++r) {
      const Simd::V x_lo = Simd::load(x + r * x_stride + k);
      const Simd::V x_hi = Simd::load(x + r * x_stride + k + Simd::kLanes);
      for (int j = 0; j < kW; ++j)
        acc[j][r] = Simd::fma(hi[j], x_hi, Simd::fma(lo[j], x_lo, acc[j][r]));
    }
  }
  for (int j = 0; j < kW; ++j)
    for (int r = 0; r < kX; ++r) dots[j * M + r] += Simd::sum(acc[j][r]);
#endif
  for (; k < len; ++k)
    for (int j = 0; j < kW; ++j)
      for (int r = 0; r < kX; ++r)
        dots[j * M + r] += kE4m3Table[w[j * w_stride + k]] * x[r * x_stride + k];
}

// kW weight rows times the last `rest` (< kRowGroup) rows of x.
template <int kW, int kX = kRowGroup - 1>
void dot_tail(int64_t rest, const uint8_t* w, int64_t w_stride, const float* x, int64_t x_stride,
              int64_t len, float* dots, int64_t M) {
  if constexpr (kX > 0) {
    if (rest == kX)
      dot_tile<kW, kX>(w, w_stride, x, x_stride, len, dots, M);
    else
      dot_tail<kW, kX - 1>(rest, w, w_stride, x, x_stride, len, dots, M);
  }
}

// kW weight rows times all M rows of x, in groups of kRowGroup rows.
template <int kW>
void dot_rows(const uint8_t* w, int64_t w_stride, const float* x, int64_t x_stride, int64_t len,
              float* dots, int64_t M) {
  int64_t m = 0;
  for (; m + kRowGroup <= M; m += kRowGroup)
    dot_tile<kW, kRowGroup>(w, w_stride, x + m * x_stride, x_stride, len, dots + m, M);
  dot_tail<kW>(M - m, w, w_stride, x + m * x_stride, x_stride, len, dots + m, M);
}

}  // namespace splitserve::fp8
