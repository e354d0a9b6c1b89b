// The register tiles of the dense float32-math kernel (cpu_dense_linear.cpp, and its GEMM,
// cpu_gemm.h): Vec, one vector of float32 lanes per ISA (AVX-512F, AVX2, Arm NEON on
// kernels/cpu_vec8.h, generic), the dot-product tiles of few rows and the GEMM tile. No
// torch headers: tests/kernels/test_neon_dense.py builds the Arm tiles for aarch64 and runs
// them in an emulator against the AVX2 build, bitwise.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_math.h"
#include "cpu_vec8.h"

namespace {

using splitserve::bf16_to_float;

// Vec::load_pair reads 2 vectors of bf16 values, 2 * kLanes, and widens them to floats by
// interleaving them with zeros: one shuffle a vector, off the FMA ports (a shift there
// competed with the GEMM's FMAs). x86's interleave takes each 128-bit lane's first 4
// values into the first vector and its last 4 into the second, so the values are stored
// in that order (`pair_slot`: where value c of the pair sits); generic code keeps them in
// order.
constexpr int64_t interleaved_slot(int64_t c, int64_t lanes) {
  const int64_t half = c / lanes, i = c % lanes;
  return i / 4 * 8 + half * 4 + i % 4;
}

#if defined(SPLITSERVE_AVX512)
struct Vec {
  static constexpr int kLanes = 16, kFeatures = 4, kRows = 6, kGemmTileRows = 14;
  __m512 v;
  static constexpr int64_t pair_slot(int64_t c) { return interleaved_slot(c, kLanes); }
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec broadcast(const float* p) { return {_mm512_set1_ps(*p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec load(const uint16_t* p) { return {splitserve::bf16x16_to_float(p)}; }
  static void load_pair(const uint16_t* p, Vec& lo, Vec& hi) {
    const __m512i v = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
    lo.v = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
    hi.v = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v));
  }
  void fma(const Vec& a, const Vec& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  void add(const Vec& a) { v = _mm512_add_ps(a.v, v); }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(SPLITSERVE_AVX2)
struct Vec {
  static constexpr int kLanes = 8, kFeatures = 3, kRows = 4, kGemmTileRows = 6;
  __m256 v;
  static constexpr int64_t pair_slot(int64_t c) { return interleaved_slot(c, kLanes); }
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec broadcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Vec load(const uint16_t* p) { return {splitserve::bf16x8_to_float(p)}; }
  static void load_pair(const uint16_t* p, Vec& lo, Vec& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i z = _mm256_setzero_si256();
    lo.v = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    hi.v = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
  void fma(const Vec& a, const Vec& b) { v = _mm256_fmadd_ps(a.v, b.v, v); }
  void add(const Vec& a) { v = _mm256_add_ps(a.v, v); }
  float sum() const { return splitserve::sum8(v); }
};
#elif defined(SPLITSERVE_NEON)
struct Vec {  // kernels/cpu_vec8.h's V8: AVX2's tiles, on 32 registers of 4 lanes
  static constexpr int kLanes = 8, kFeatures = 3, kRows = 4, kGemmTileRows = 6;
  splitserve::V8 v;
  static constexpr int64_t pair_slot(int64_t c) { return c; }  // zip keeps the order
  static Vec zero() { return {splitserve::zero8()}; }
  static Vec load(const float* p) { return {splitserve::load8(p)}; }
  static Vec broadcast(const float* p) { return {splitserve::set8(*p)}; }
  void store(float* p) const { splitserve::store8(p, v); }
  static Vec load(const uint16_t* p) {
    return {splitserve::widen8(reinterpret_cast<const c10::BFloat16*>(p))};
  }
  static void load_pair(const uint16_t* p, Vec& lo, Vec& hi) {
    const uint16x8_t a = vld1q_u16(p), b = vld1q_u16(p + 8), z = vdupq_n_u16(0);
    lo.v = {vreinterpretq_f32_u16(vzip1q_u16(z, a)), vreinterpretq_f32_u16(vzip2q_u16(z, a))};
    hi.v = {vreinterpretq_f32_u16(vzip1q_u16(z, b)), vreinterpretq_f32_u16(vzip2q_u16(z, b))};
  }
  void fma(const Vec& a, const Vec& b) { v = splitserve::fmadd8(a.v, b.v, v); }
  void add(const Vec& a) { v = splitserve::add8(a.v, v); }
  float sum() const { return splitserve::sum8(v); }
};
#else
struct Vec {
  static constexpr int kLanes = 8, kFeatures = 2, kRows = 2, kGemmTileRows = 4;
  float v[kLanes];
  static Vec zero() { return {}; }
  static Vec load(const float* p) {
    Vec r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
    return r;
  }
  static Vec broadcast(const float* p) {
    Vec r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = *p;
    return r;
  }
  void store(float* p) const {
    for (int i = 0; i < kLanes; ++i) p[i] = v[i];
  }
  static Vec load(const uint16_t* p) {
    Vec r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = bf16_to_float(p[i]);
    return r;
  }
  static void load_pair(const uint16_t* p, Vec& lo, Vec& hi) {
    lo = load(p);
    hi = load(p + kLanes);
  }
  static constexpr int64_t pair_slot(int64_t c) { return c; }
  void fma(const Vec& a, const Vec& b) {
    for (int i = 0; i < kLanes; ++i) v[i] += a.v[i] * b.v[i];
  }
  void add(const Vec& a) {
    for (int i = 0; i < kLanes; ++i) v[i] += a.v[i];
  }
  float sum() const {
    float s = 0.0f;
    for (int i = 0; i < kLanes; ++i) s += v[i];
    return s;
  }
};
#endif

constexpr int64_t kGemmCols = 2 * Vec::kLanes;  // features of a GEMM panel

// sums[r * F + f] = x row r . W row f, over K features. The next F rows of W are
// prefetched as these are read: the hardware prefetchers start each row's stream late.
// Into L2: prefetches into L1 wait on the core's few L1 miss buffers (2 Zen 4 cores,
// SmolLM2's layers at 1 row: float32 23-24 -> 17-19 ms, bf16 13-14 -> 8-9 ms).
inline float widen(uint16_t w) { return bf16_to_float(w); }
inline float widen(float w) { return w; }

template <int F, int R, typename W>
inline void dot_tile(const W* w, int64_t w_stride, const float* x, int64_t x_stride,
                     int64_t K, float* sums) {
  Vec acc[R][F];
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) acc[r][f] = Vec::zero();
  int64_t k = 0;
  for (; k + Vec::kLanes <= K; k += Vec::kLanes) {
    Vec wv[F];
    for (int f = 0; f < F; ++f) {
      __builtin_prefetch(w + (f + F) * w_stride + k, 0, 2);
      wv[f] = Vec::load(w + f * w_stride + k);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::load(x + r * x_stride + k);
      for (int f = 0; f < F; ++f) acc[r][f].fma(wv[f], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) {
      float s = acc[r][f].sum();
      for (int64_t j = k; j < K; ++j) s += widen(w[f * w_stride + j]) * x[r * x_stride + j];
      sums[r * F + f] = s;
    }
}

// The tile of the last n < R rows: one of R - 1 rows or fewer.
template <int F, int R, typename W>
inline void dot_rows(int64_t n, const W* w, int64_t w_stride, const float* x,
                     int64_t K, float* sums) {
  if constexpr (R > 1) {
    if (n < R) return dot_rows<F, R - 1, W>(n, w, w_stride, x, K, sums);
  }
  dot_tile<F, R, W>(w, w_stride, x, K, K, sums);
}

// A tile's share of the weights to prefetch (into L2) while it computes, spread evenly
// over its K steps: `lines` cache lines from `from` on. The hardware prefetchers follow a
// stream only within a 4 KB page, so every page of a panel began with a wait for memory;
// and while a panel's later tiles of rows read it from the cache, memory sat idle. Now the
// tiles of a panel prefetch the next panel, a share each, and a thread's first tile its
// own, kGemmAheadBytes ahead of its k. On 2 Emerald Rapids cores, SmolLM2's 120 layer
// weights (424 MB), ms: 8 rows 30-32 -> 17-18, 16 rows (two tiles) 36 -> 20-21, 33 rows
// (three) 46 -> 26, 65 rows (five) 50-52 -> 41-43, the FMA peak.
struct Prefetch {
  const char* from = nullptr;
  int64_t lines = 0;
};
constexpr int64_t kLineBytes = 64;
constexpr int64_t kGemmAheadBytes = 8 << 10;

// out[r * ldo + c] = x row r . panel feature c (+ bias[c]), for R rows K apart; a bf16
// panel (P uint16_t) widened as it is loaded.
template <int R, typename P>
__attribute__((noinline)) void gemm_tile(const float* x, int64_t K, const P* panel,
                                         const float* bias, float* out, int64_t ldo,
                                         Prefetch prefetch) {
  Vec acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec::zero();
  const char* next = prefetch.from;
  int64_t due = 0;  // lines owed, in K-ths
  for (int64_t k = 0; k < K; ++k) {
    for (due += prefetch.lines; due >= K; due -= K, next += kLineBytes)
      __builtin_prefetch(next, 0, 2);
    Vec b0, b1;
    if constexpr (std::is_same_v<P, float>) {
      b0 = Vec::load(panel + k * kGemmCols);
      b1 = Vec::load(panel + k * kGemmCols + Vec::kLanes);
    } else {
      Vec::load_pair(panel + k * kGemmCols, b0, b1);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec a = Vec::broadcast(x + r * K + k);
      acc[r][0].fma(a, b0);
      acc[r][1].fma(a, b1);
    }
  }
  if (bias != nullptr) {
    const Vec b0 = Vec::load(bias), b1 = Vec::load(bias + Vec::kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[r][0].add(b0);
      acc[r][1].add(b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0].store(out + r * ldo);
    acc[r][1].store(out + r * ldo + Vec::kLanes);
  }
}

// gemm_tile<rows>, 1 <= rows <= R.
template <int R = Vec::kGemmTileRows, typename P>
inline void gemm_rows(int rows, const float* x, int64_t K, const P* panel, const float* bias,
                      float* out, int64_t ldo, Prefetch prefetch) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_rows<R - 1>(rows, x, K, panel, bias, out, ldo, prefetch);
  }
  gemm_tile<R, P>(x, K, panel, bias, out, ldo, prefetch);
}

}  // namespace
