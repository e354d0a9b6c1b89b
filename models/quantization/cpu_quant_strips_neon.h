// The strip passes of cpu_quant_strips.cpp for Arm. A strip's 8 features are two 128-bit
// registers of 4 lanes (features 0-3 and 4-7), and a chunk's 32 bytes are the same 4 bytes
// of each feature, so Armv8.2-A's `sdot` by element (SPLITSERVE_NEON_DOTPROD) multiplies 4
// weight bytes of 4 features by 4 activations picked out of a register of 16, no
// broadcast; Armv8.0 builds get the same integer sums from widening multiplies and
// pairwise adds (dot_lane). Both sides are signed bytes: 4-bit values (0..15) and 8-bit
// weights as they are (no offset or sign moves as on x86). The float operations are the
// x86 passes' in the same order: the results are bitwise theirs. No torch headers but
// c10's number types: tests/kernels/test_neon_strips.py builds them for aarch64, with and
// without the extension, and runs them in an emulator.
#pragma once

#include <cstdint>
#include <utility>

#include "cpu_quant_layout.h"
#include "cpu_vec8.h"

namespace splitserve::quant::neon {

constexpr int64_t kMaxStripRows = 4;  // a row's x, sums and totals: 6-8 of 32 registers

using splitserve::V8;  // a strip's 8 features as float32 (kernels/cpu_vec8.h)
using splitserve::fmadd8;
using splitserve::set8;

// 8 features' scales (or mins) of strip s, block j.
inline V8 scales8(const Strips& w, const void* table, int64_t s, int64_t j) {
  const int64_t at = (s * w.blocks() + j) * kStrip;
  return w.half ? splitserve::widen8(static_cast<const c10::Half*>(table) + at)
                : splitserve::widen8(static_cast<const float*>(table) + at);
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
inline V8 q_at(const uint8_t* run, int h, int i) {
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
  V8 acc[R];
  for (auto& v : acc) v = splitserve::zero8();
  const uint8_t* q = w.q + s * w.strip_bytes();
  const int64_t halves = w.K / 16;
  for (int64_t k = 0; k < w.K; k += kRun) {
    const uint8_t* run = q + k / kRun * w.run_bytes();
    for (int h = 0; h < 2; ++h) {
      V8 dot[R][C];
      for (auto& row : dot)
        for (auto& v : row) v = splitserve::zero8();
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const V8 qv = q_at<Bits>(run, h, i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          dot[r][i % C] = fmadd8(qv, set8(x[r * ldx + k + 16 * h + i]), dot[r][i % C]);
      }
      const int64_t j = (k + 16 * h) / w.block_size;
      const V8 scale = scales8(w, w.scales, s, j);
      for (int r = 0; r < R; ++r) {
        V8 d = dot[r][0];
        for (int c = 1; c < C; ++c) d = splitserve::add8(d, dot[r][c]);
        acc[r] = fmadd8(d, scale, acc[r]);
      }
      if (w.mins != nullptr) {
        const V8 min = scales8(w, w.mins, s, j);
        for (int r = 0; r < R; ++r)
          acc[r] = fmadd8(min, set8(xsums[r * halves + (k + 16 * h) / 16]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) splitserve::store8(res[r], acc[r]);
}

// ---- int8 activations ---------------------------------------------------------------

// int32 dot products of a strip's 8 features (lo: 0-3, hi: 4-7).
struct I8 {
  int32x4_t lo, hi;
};

// acc plus, per lane, the dot product of its 4 bytes of w with the 4 bytes in lane L of x.
// Without `sdot`: the byte products widened to int16 (smull), adjacent ones summed (addp:
// |a pair| <= 2 * 128 * 127 fits), then adjacent pairs into the int32 lanes (sadalp).
template <int L>
inline int32x4_t dot_lane(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(SPLITSERVE_NEON_DOTPROD)
  return vdotq_laneq_s32(acc, w, x, L);
#else
  const int8x16_t xl = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), L));
  return vpadalq_s16(acc, vpaddq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(xl)),
                                     vmull_high_s8(w, xl)));
#endif
}

// acc plus chunk (w0: features 0-3, w1: 4-7) times the 4 activations in lane L of x.
template <int L>
inline I8 add_chunk(I8 acc, int8x16_t w0, int8x16_t w1, int8x16_t x) {
  return {dot_lane<L>(acc.lo, w0, x), dot_lane<L>(acc.hi, w1, x)};
}

inline V8 to_float(I8 v) { return {vcvtq_f32_s32(v.lo), vcvtq_f32_s32(v.hi)}; }

// As the x86 strip_pass_int8 (Whole: every run in one weight block, one sum per row).
// Chunk c of a 4-bit run holds inputs 4c..4c+3 (low nibbles) and 4c+16.. (high), of an
// 8-bit one inputs 4c..4c+3: x's first 16 inputs feed chunks 0-3 (and the low nibbles),
// its second 16 the rest.
template <int Bits, bool Whole, int R>
void strip_pass_int8(const Strips& w, int64_t s, const Acts& a, int64_t m, float (*res)[kStrip]) {
  constexpr int H = Whole ? 1 : 2;  // sums per row: per half of the run, or both
  const int64_t K = w.K;
  V8 acc[R];
  for (auto& v : acc) v = splitserve::zero8();
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
    const V8 s0 = scales8(w, w.scales, s, j0);
    const V8 s1 = Whole || j1 == j0 ? s0 : scales8(w, w.scales, s, j1);
    for (int r = 0; r < R; ++r) {
      const float d = a.d[(m + r) * a.runs + k / kRun];
      if (Whole || j1 == j0) {
        const I8 both = Whole ? dot[r][0]
                              : I8{vaddq_s32(dot[r][0].lo, dot[r][H - 1].lo),
                                   vaddq_s32(dot[r][0].hi, dot[r][H - 1].hi)};
        acc[r] = fmadd8(to_float(both), splitserve::mul8(s0, set8(d)), acc[r]);
      } else {
        acc[r] = fmadd8(to_float(dot[r][0]), splitserve::mul8(s0, set8(d)), acc[r]);
        acc[r] = fmadd8(to_float(dot[r][H - 1]), splitserve::mul8(s1, set8(d)), acc[r]);
      }
    }
  }
  if (w.mins != nullptr) {  // plus mins[j] * (sum of the dequantized x over block j)
    const int64_t blocks = w.blocks();
    for (int64_t j = 0; j < blocks; ++j) {
      const V8 mv = scales8(w, w.mins, s, j);
      for (int r = 0; r < R; ++r) acc[r] = fmadd8(mv, set8(a.sums[(m + r) * blocks + j]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) splitserve::store8(res[r], acc[r]);
}

}  // namespace splitserve::quant::neon
