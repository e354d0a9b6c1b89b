// The strip passes of cpu_quant_strips.cpp on x86 (AVX2 builds, and AVX512-BF16 ones
// without AMX): one 256-bit register holds a strip's 8 features. Integer dot products:
// maddubs on unsigned 4-bit values (4 chunks' int16 sums cannot overflow), and for 8-bit
// weights |q| with q's signs moved onto x; with VNNI (AVX512-BF16 builds, up to 8 rows a
// pass, and AVX-VNNI ones, up to 4) vpdpbusd sums into int32 directly, and 8-bit weights
// meet x + 128 as unsigned bytes (Acts offset), 128 * sum(q) taken off once per run for
// every row (no saturation in vpdpbusd, unlike maddubs).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_quant_layout.h"
#include "cpu_quant_linear.h"

namespace splitserve::quant::x86 {

// 8 features' scales (or mins) of strip s, block j.
inline __m256 load8(const Strips& w, const void* table, int64_t s, int64_t j) {
  const int64_t at = (s * w.blocks() + j) * kStrip;
  return w.half ? widen8(static_cast<const c10::Half*>(table) + at)
                : widen8(static_cast<const float*>(table) + at);
}

inline __m256i load_chunk(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// ---- x float32 -----------------------------------------------------------------------

// Input i (0..15) of half h of a run, for 8 features, as floats.
template <int Bits>
inline __m256 q_at(const uint8_t* run, int h, int i) {
  const int b = i % 4;
  if constexpr (Bits == 4) {
    const __m256i v = load_chunk(run + 32 * (i / 4));
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srli_epi32(v, 8 * b + 4 * h), _mm256_set1_epi32(0x0F)));
  } else {
    const __m256i v = load_chunk(run + 32 * (4 * h + i / 4));
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24));
  }
}

// Row r's dot products over each half of each run: sum of q * x per feature, then scaled
// (w = s * q + m: s * sum(q x) + m * sum(x), the sums of x over each half in xsums).
template <int Bits, int R>
void strip_pass_f32(const Strips& w, int64_t s, const float* x, int64_t ldx, const float* xsums,
                    float (*res)[kStrip]) {
  constexpr int C = R <= 2 ? 4 : 2;  // independent sums per row, to hide the FMA latency
  __m256 acc[R];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const uint8_t* q = w.q + s * w.strip_bytes();
  const int64_t halves = w.K / 16;
  for (int64_t k = 0; k < w.K; k += kRun) {
    const uint8_t* run = q + k / kRun * w.run_bytes();
    for (int h = 0; h < 2; ++h) {
      __m256 dot[R][C];
      for (auto& row : dot)
        for (auto& v : row) v = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const __m256 qv = q_at<Bits>(run, h, i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          dot[r][i % C] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(x + r * ldx + k + 16 * h + i),
                                          dot[r][i % C]);
      }
      const int64_t j = (k + 16 * h) / w.block_size;
      const __m256 scale = load8(w, w.scales, s, j);
      for (int r = 0; r < R; ++r) {
        __m256 d = dot[r][0];
        for (int c = 1; c < C; ++c) d = _mm256_add_ps(d, dot[r][c]);
        acc[r] = _mm256_fmadd_ps(d, scale, acc[r]);
      }
      if (w.mins != nullptr) {
        const __m256 min = load8(w, w.mins, s, j);
        for (int r = 0; r < R; ++r) {
          const __m256 xsum = _mm256_set1_ps(xsums[r * halves + (k + 16 * h) / 16]);
          acc[r] = _mm256_fmadd_ps(min, xsum, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_store_ps(res[r], acc[r]);
}

// ---- int8 activations ---------------------------------------------------------------

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc plus a 4-bit chunk's products: int32 lanes with VNNI, else int16 pairs, which the
// caller widens after the run's 4 chunks (at most 4 * 2 * 15 * 127 per half, twice that
// for both halves: no overflow).
inline __m256i add_q4_chunk(__m256i acc, __m256i u, __m256i a) {
  if constexpr (kVnni) return add_dot4(acc, u, a);
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, a));
}

// Whole: every 32-run lies in one weight block (block sizes that are multiples of 32), so
// both halves of a run share a scale and sum into one accumulator per row. The 8-bit chunk
// loops are unrolled so that a chunk's half (c / 4) is a constant: left a loop, gcc kept
// the sums of blocks of 16 (Q6_K) in an array on the stack (20-65 % slower).
template <int Bits, bool Whole, int R>
void strip_pass_int8(const Strips& w, int64_t s, const Acts& a, int64_t m, float (*res)[kStrip]) {
  constexpr int H = Whole ? 1 : 2;  // accumulators per row
  const int64_t K = w.K;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const uint8_t* q = w.q + s * w.strip_bytes();
  for (int64_t k = 0; k < K; k += kRun) {
    const uint8_t* run = q + k / kRun * w.run_bytes();
    const int64_t j0 = a.half_block[k / 16], j1 = a.half_block[k / 16 + 1];
    __m256i dot[R][H];  // int32 per feature, per half of the run (Whole: both)
    if constexpr (Bits == 4) {
      __m256i sum[R][H];
      for (auto& row : sum)
        for (auto& v : row) v = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load_chunk(run + 32 * c);
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q + (m + r) * K + k + 4 * c;
          sum[r][0] = add_q4_chunk(sum[r][0], lo, bcast4(x));
          sum[r][H - 1] = add_q4_chunk(sum[r][H - 1], hi, bcast4(x + 16));
          for (auto& v : sum[r]) opaque(v);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h)
          dot[r][h] = kVnni ? sum[r][h] : _mm256_madd_epi16(sum[r][h], _mm256_set1_epi16(1));
    } else if constexpr (kVnni) {  // x + 128 (unsigned) times q, less 128 * sum(q)
      __m256i qsum[H];
      for (auto& v : qsum) v = _mm256_setzero_si256();
      for (auto& row : dot)
        for (auto& v : row) v = _mm256_setzero_si256();
      const __m256i ones = _mm256_set1_epi8(1);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i v = load_chunk(run + 32 * c);
        qsum[Whole ? 0 : c / 4] = add_dot4(qsum[Whole ? 0 : c / 4], ones, v);
        for (int r = 0; r < R; ++r) {
          __m256i& d = dot[r][Whole ? 0 : c / 4];
          d = add_dot4(d, bcast4(a.q + (m + r) * K + k + 4 * c), v);
        }
      }
      for (int h = 0; h < H; ++h) {
        const __m256i offset = _mm256_slli_epi32(qsum[h], 7);
        for (int r = 0; r < R; ++r) dot[r][h] = _mm256_sub_epi32(dot[r][h], offset);
      }
    } else {
      for (auto& row : dot)
        for (auto& v : row) v = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i v = load_chunk(run + 32 * c), u = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {  // |q| <= 128, |x| <= 127: no saturation
          const __m256i xs = _mm256_sign_epi8(bcast4(a.q + (m + r) * K + k + 4 * c), v);
          __m256i& d = dot[r][Whole ? 0 : c / 4];
          d = add_dot4(d, u, xs);
          opaque(d);
        }
      }
    }
    const __m256 s0 = load8(w, w.scales, s, j0);
    if constexpr (Whole) {
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(a.d[(m + r) * a.runs + k / kRun]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(s0, d), acc[r]);
      }
    } else {
      const __m256 s1 = j1 == j0 ? s0 : load8(w, w.scales, s, j1);
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(a.d[(m + r) * a.runs + k / kRun]);
        if (j1 == j0) {
          const __m256 both = _mm256_cvtepi32_ps(_mm256_add_epi32(dot[r][0], dot[r][H - 1]));
          acc[r] = _mm256_fmadd_ps(both, _mm256_mul_ps(s0, d), acc[r]);
        } else {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(s0, d), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][H - 1]), _mm256_mul_ps(s1, d), acc[r]);
        }
      }
    }
  }
  if (w.mins != nullptr) {  // plus mins[j] * (sum of the dequantized x over block j)
    const int64_t blocks = w.blocks();
    for (int64_t j = 0; j < blocks; ++j) {
      const __m256 mv = load8(w, w.mins, s, j);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.sums[(m + r) * blocks + j]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_store_ps(res[r], acc[r]);
}

}  // namespace splitserve::quant::x86
