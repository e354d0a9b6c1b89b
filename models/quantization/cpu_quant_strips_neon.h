// The strip passes of cpu_quant_strips.cpp for Arm with the dot-product extension
// (SPLITSERVE_NEON_DOTPROD, Armv8.2-A's `sdot`). A strip's 8 features are two 128-bit
// registers of 4 lanes (features 0-3 and 4-7), and a chunk's 32 bytes are the same 4 bytes
// of each feature, so `sdot` by element multiplies 4 weight bytes of 4 features by 4
// activations picked out of a register of 16, no broadcast. Both sides are signed bytes:
// 4-bit values (0..15) and 8-bit weights as they are (no offset or sign moves as on x86).
// The float operations are the x86 passes' in the same order: the results are bitwise
// theirs. Plain C++ and NEON (no torch headers): tests/kernels/test_neon_strips.py builds
// them for aarch64 and runs them in an emulator.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <utility>

#include "cpu_quant_layout.h"

namespace splitserve::quant::neon {

constexpr int64_t kMaxStripRows = 4;  // a row's x, sums and totals: 6-8 of 32 registers

// Float32 values of a strip's 8 features.
struct F8 {
  float32x4_t lo, hi;
};

inline F8 zeros8() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
inline F8 fma8(F8 acc, F8 a, F8 b) {
  return {vfmaq_f32(acc.lo, a.lo, b.lo), vfmaq_f32(acc.hi, a.hi, b.hi)};
}
inline F8 fma8(F8 acc, F8 a, float b) {
  return {vfmaq_n_f32(acc.lo, a.lo, b), vfmaq_n_f32(acc.hi, a.hi, b)};
}
inline F8 mul8(F8 a, float b) { return {vmulq_n_f32(a.lo, b), vmulq_n_f32(a.hi, b)}; }
inline void store8(float* out, F8 v) {
  vst1q_f32(out, v.lo);
  vst1q_f32(out + 4, v.hi);
}

// 8 features' scales (or mins) of strip s, block j.
inline F8 load8(const Strips& w, const void* table, int64_t s, int64_t j) {
  const int64_t at = (s * w.blocks() + j) * kStrip;
  if (w.half) {
    const uint16x8_t bits = vld1q_u16(static_cast<const uint16_t*>(table) + at);
    const float16x8_t h = vreinterpretq_f16_u16(bits);
    return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
  }
  const float* f = static_cast<const float*>(table) + at;
  return {vld1q_f32(f), vld1q_f32(f + 4)};
}

// Calls body(integral_constant<int, I>) for I = 0 .. N - 1: lane numbers must be constants.
template <int N, typename Body>
inline void each_lane(const Body& body) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (body(std::integral_constant<int, I>()), ...);
  }(std::make_integer_sequence<int, N>());
}

// ---- x float32 -----------------------------------------------------------------------

// Input i (0..15) of half h of a run, for 8 features, as floats (as q_at on x86).
template <int Bits>
inline F8 q_at(const uint8_t* run, int h, int i) {
  const int b = i % 4;
  if constexpr (Bits == 4) {
    const uint8_t* p = run + 32 * (i / 4);
    const int32x4_t shift = vdupq_n_s32(-(8 * b + 4 * h));
    const uint32x4_t low = vdupq_n_u32(0x0F);
    const auto value = [&](const uint8_t* at) {
      return vcvtq_f32_u32(vandq_u32(vshlq_u32(vld1q_u32(reinterpret_cast<const uint32_t*>(at)),
                                               shift),
                                     low));
    };
    return {value(p), value(p + 16)};
  } else {
    const uint8_t* p = run + 32 * (4 * h + i / 4);
    const int32x4_t up = vdupq_n_s32(24 - 8 * b), down = vdupq_n_s32(-24);
    const auto value = [&](const uint8_t* at) {
      const int32x4_t v = vld1q_s32(reinterpret_cast<const int32_t*>(at));
      return vcvtq_f32_s32(vshlq_s32(vshlq_s32(v, up), down));
    };
    return {value(p), value(p + 16)};
  }
}

// As cpu_quant_strips.cpp's AVX2 strip_pass_f32: per half, sum(q x) in C chains, scaled.
template <int Bits, int R>
void strip_pass_f32(const Strips& w, int64_t s, const float* x, int64_t ldx, const float* xsums,
                    float (*res)[kStrip]) {
  constexpr int C = R <= 2 ? 4 : 2;
  F8 acc[R];
  for (auto& v : acc) v = zeros8();
  const uint8_t* q = w.q + s * w.strip_bytes();
  const int64_t halves = w.K / 16;
  for (int64_t k = 0; k < w.K; k += kRun) {
    const uint8_t* run = q + k / kRun * w.run_bytes();
    for (int h = 0; h < 2; ++h) {
      F8 dot[R][C];
      for (auto& row : dot)
        for (auto& v : row) v = zeros8();
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const F8 qv = q_at<Bits>(run, h, i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          dot[r][i % C] = fma8(dot[r][i % C], qv, x[r * ldx + k + 16 * h + i]);
      }
      const int64_t j = (k + 16 * h) / w.block_size;
      const F8 scale = load8(w, w.scales, s, j);
      for (int r = 0; r < R; ++r) {
        F8 d = dot[r][0];
        for (int c = 1; c < C; ++c)
          d = {vaddq_f32(d.lo, dot[r][c].lo), vaddq_f32(d.hi, dot[r][c].hi)};
        acc[r] = fma8(acc[r], d, scale);
      }
      if (w.mins != nullptr) {
        const F8 min = load8(w, w.mins, s, j);
        for (int r = 0; r < R; ++r)
          acc[r] = fma8(acc[r], min, xsums[r * halves + (k + 16 * h) / 16]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store8(res[r], acc[r]);
}

// ---- int8 activations ---------------------------------------------------------------

// int32 dot products of a strip's 8 features (lo: 0-3, hi: 4-7).
struct I8 {
  int32x4_t lo, hi;
};

// acc plus chunk (w0: features 0-3, w1: 4-7) times the 4 activations in lane L of x.
template <int L>
inline I8 add_chunk(I8 acc, int8x16_t w0, int8x16_t w1, int8x16_t x) {
  return {vdotq_laneq_s32(acc.lo, w0, x, L), vdotq_laneq_s32(acc.hi, w1, x, L)};
}

inline F8 to_float(I8 v) { return {vcvtq_f32_s32(v.lo), vcvtq_f32_s32(v.hi)}; }

// As the x86 strip_pass_int8 (Whole: every run in one weight block, one sum per row).
// Chunk c of a 4-bit run holds inputs 4c..4c+3 (low nibbles) and 4c+16.. (high), of an
// 8-bit one inputs 4c..4c+3: x's first 16 inputs feed chunks 0-3 (and the low nibbles),
// its second 16 the rest.
template <int Bits, bool Whole, int R>
void strip_pass_int8(const Strips& w, int64_t s, const Acts& a, int64_t m, float (*res)[kStrip]) {
  constexpr int H = Whole ? 1 : 2;  // sums per row: per half of the run, or both
  const int64_t K = w.K;
  F8 acc[R];
  for (auto& v : acc) v = zeros8();
  const uint8_t* q = w.q + s * w.strip_bytes();
  const uint8x16_t low = vdupq_n_u8(0x0F);
  for (int64_t k = 0; k < K; k += kRun) {
    const uint8_t* run = q + k / kRun * w.run_bytes();
    const int64_t j0 = a.half_block[k / 16], j1 = a.half_block[k / 16 + 1];
    int8x16_t x[R][2];
    I8 dot[R][H];
    for (int r = 0; r < R; ++r) {
      x[r][0] = vld1q_s8(a.q + (m + r) * K + k);
      x[r][1] = vld1q_s8(a.q + (m + r) * K + k + 16);
      for (auto& d : dot[r]) d = {vdupq_n_s32(0), vdupq_n_s32(0)};
    }
    if constexpr (Bits == 4) {
      each_lane<4>([&](auto c) {
        const uint8x16_t v0 = vld1q_u8(run + 32 * c), v1 = vld1q_u8(run + 32 * c + 16);
        const int8x16_t lo0 = vreinterpretq_s8_u8(vandq_u8(v0, low));
        const int8x16_t lo1 = vreinterpretq_s8_u8(vandq_u8(v1, low));
        const int8x16_t hi0 = vreinterpretq_s8_u8(vshrq_n_u8(v0, 4));
        const int8x16_t hi1 = vreinterpretq_s8_u8(vshrq_n_u8(v1, 4));
        for (int r = 0; r < R; ++r) {
          dot[r][0] = add_chunk<c>(dot[r][0], lo0, lo1, x[r][0]);
          dot[r][H - 1] = add_chunk<c>(dot[r][H - 1], hi0, hi1, x[r][1]);
        }
      });
    } else {
      each_lane<8>([&](auto c) {
        const int8x16_t v0 = vld1q_s8(reinterpret_cast<const int8_t*>(run) + 32 * c);
        const int8x16_t v1 = vld1q_s8(reinterpret_cast<const int8_t*>(run) + 32 * c + 16);
        for (int r = 0; r < R; ++r) {
          I8& d = dot[r][Whole ? 0 : c / 4];
          d = add_chunk<c % 4>(d, v0, v1, x[r][c / 4]);
        }
      });
    }
    const F8 s0 = load8(w, w.scales, s, j0);
    const F8 s1 = Whole || j1 == j0 ? s0 : load8(w, w.scales, s, j1);
    for (int r = 0; r < R; ++r) {
      const float d = a.d[(m + r) * a.runs + k / kRun];
      if (Whole || j1 == j0) {
        const I8 both = Whole ? dot[r][0]
                              : I8{vaddq_s32(dot[r][0].lo, dot[r][H - 1].lo),
                                   vaddq_s32(dot[r][0].hi, dot[r][H - 1].hi)};
        acc[r] = fma8(acc[r], to_float(both), mul8(s0, d));
      } else {
        acc[r] = fma8(acc[r], to_float(dot[r][0]), mul8(s0, d));
        acc[r] = fma8(acc[r], to_float(dot[r][H - 1]), mul8(s1, d));
      }
    }
  }
  if (w.mins != nullptr) {  // plus mins[j] * (sum of the dequantized x over block j)
    const int64_t blocks = w.blocks();
    for (int64_t j = 0; j < blocks; ++j) {
      const F8 mv = load8(w, w.mins, s, j);
      for (int r = 0; r < R; ++r) acc[r] = fma8(acc[r], mv, a.sums[(m + r) * blocks + j]);
    }
  }
  for (int r = 0; r < R; ++r) store8(res[r], acc[r]);
}

}  // namespace splitserve::quant::neon
