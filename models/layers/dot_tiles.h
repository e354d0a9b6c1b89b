// Dot-product tiles for weights read where they lie (the fused-experts kernel cpu_moe.cpp,
// the bf16 linear kernel cpu_bf16_linear.cpp): out[r][c] = a[r] . w[c] for R rows of
// activations by C rows of a weight [N, K], both contiguous along k.
//
// The weight is read where it lies (float32 or bf16 rows [N, K], no packing per call): a
// block (`dot_block`) streams its weight rows from memory once, for its first 4 activation
// rows, and from the cache for each further 4. Decode, a row or two (per expert), thus reads
// every active weight once at memory speed; the first pass prefetches each tile's
// successor, and `Ahead` the next block's rows, spread over this one. The activations are
// packed per call instead (`pack_row`, a float32 copy): k runs in steps of 16, two vectors
// of 8 floats; a bf16 weight's step is one 32-byte load whose even elements widen to floats
// by a shift and odd ones by a mask, so a packed row holds each step's even k, then its odd
// k (`deinterleave`). The k past the last whole step stay in order and are summed one by
// one. On CPUs with AVX-512 BF16, bf16 activations and weights take the tiles of
// dot_tiles_bf16.h instead, on rows packed as they are (`Packed`). AVX2 tiles, and the same
// on Arm (cpu_vec8.h), else a generic baseline; tests/kernels/test_neon_dense.py runs the
// Arm tiles in an emulator.
#pragma once

#include "cpu_math.h"
#include "cpu_vec8.h"
#include "dot_tiles_bf16.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace splitserve::dot {

constexpr int64_t kStep = 16;

#if defined(SPLITSERVE_AVX512_BF16)
constexpr bool kBf16Tiles = true;
#else
constexpr bool kBf16Tiles = false;
#endif
// What a packed activation row holds against weights of type W: bf16 bits where the bf16
// tiles run (dot_tiles_bf16.h), else float32.
template <typename W>
using Packed = std::conditional_t<kBf16Tiles && sizeof(W) == 2, uint16_t, float>;

template <typename T>
inline float to_float(T v);
template <>
inline float to_float(float v) { return v; }
template <>
inline float to_float(uint16_t v) { return bf16_to_float(v); }

// A row of k activations as the tiles read it against weights of type W (float or uint16_t
// bf16): float32, each whole step of a bf16 weight split into even then odd k; for the
// bf16 tiles, the row as it is.
template <typename W, typename X>
inline void pack_row(const X* x, int64_t k, Packed<W>* out) {
  if constexpr (std::is_same_v<Packed<W>, uint16_t>) {
    std::copy(x, x + k, out);
  } else {
    const int64_t whole = k / kStep * kStep;
    for (int64_t s = 0; s < whole; s += kStep) {
      for (int64_t i = 0; i < kStep / 2; ++i) {
        const bool deinterleave = sizeof(W) == 2;
        out[s + i] = to_float(x[s + (deinterleave ? 2 * i : i)]);
        out[s + kStep / 2 + i] = to_float(x[s + (deinterleave ? 2 * i + 1 : kStep / 2 + i)]);
      }
    }
    for (int64_t i = whole; i < k; ++i) {
      out[i] = to_float(x[i]);
    }
  }
}

#if defined(SPLITSERVE_AVX2)
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
// Keeps v in a register: else gcc folds a weight vector's load into each of the R FMAs
// that use it (R loads where one does), and the tile waits on loads, not FMAs.
inline void pin(Vec& v) { opaque(v); }

// Half `half` of a step (16 k) of a weight row: the vector matching a packed row's.
inline Vec load_half(const float* w, int half) { return _mm256_loadu_ps(w + half * 8); }
inline Vec load_half(const uint16_t* w, int half) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm256_castsi256_ps(half == 0 ? _mm256_slli_epi32(v, 16)  // even k
                                       : _mm256_and_si256(v, _mm256_set1_epi32(-65536)));
}

// The lane sums of 4 vectors: 3 horizontal adds and one add of the 128-bit halves.
inline void hsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const Vec abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
#elif defined(SPLITSERVE_NEON)
using Vec = V8;  // kernels/cpu_vec8.h: two NEON registers, AVX2's tiles on 32 of them
inline Vec vzero() { return zero8(); }
inline Vec vload(const float* p) { return load8(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return fmadd8(a, b, c); }
inline void pin(Vec& v) {
  opaque(v.lo);
  opaque(v.hi);
}
inline Vec load_half(const float* w, int half) { return load8(w + half * 8); }
inline Vec load_half(const uint16_t* w, int half) {
  const uint32x4_t a = vld1q_u32(reinterpret_cast<const uint32_t*>(w));
  const uint32x4_t b = vld1q_u32(reinterpret_cast<const uint32_t*>(w) + 4);
  if (half == 0)  // even k
    return {vreinterpretq_f32_u32(vshlq_n_u32(a, 16)), vreinterpretq_f32_u32(vshlq_n_u32(b, 16))};
  const uint32x4_t top = vdupq_n_u32(0xFFFF0000u);
  return {vreinterpretq_f32_u32(vandq_u32(a, top)), vreinterpretq_f32_u32(vandq_u32(b, top))};
}
// As AVX2's: each vector's lanes 0-3 and 4-7 summed pairwise, then the two halves.
inline void hsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const float32x4_t lo = vpaddq_f32(vpaddq_f32(a.lo, b.lo), vpaddq_f32(c.lo, d.lo));
  const float32x4_t hi = vpaddq_f32(vpaddq_f32(a.hi, b.hi), vpaddq_f32(c.hi, d.hi));
  vst1q_f32(out, vaddq_f32(lo, hi));
}
#else
// The baseline: 8 lanes in an array, which the compiler vectorises with what it has.
struct Vec {
  float v[8];
};
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec r;
  std::copy(p, p + 8, r.v);
  return r;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline void pin(Vec&) {}
inline Vec load_half(const float* w, int half) { return vload(w + half * 8); }
inline Vec load_half(const uint16_t* w, int half) {
  Vec r;
  for (int i = 0; i < 8; ++i) r.v[i] = bf16_to_float(w[2 * i + half]);
  return r;
}
inline void hsum4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const Vec* v[4] = {&a, &b, &c, &d};
  for (int j = 0; j < 4; ++j) {
    float s = 0;
    for (int i = 0; i < 8; ++i) s += v[j]->v[i];
    out[j] = s;
  }
}
#endif

// out[r * ldo + c] = a[r] . w[c] for r < R, c < C: a packed rows (stride lda), w weight
// rows (stride ldw), k long. Each half step keeps R * C accumulators, C weight vectors and
// one activation vector in registers: (4, 2) is the widest that fits AVX2's 16 (4 x 3
// spills an accumulator: 40% slower on Zen 3), 75-90 GFLOP/s a core there, as MKL's sgemm.
template <int R, int C, bool Prefetch, typename W>
inline void dot_tile(const float* a, int64_t lda, const W* w, int64_t ldw, int64_t k,
                     float* out, int64_t ldo) {
  Vec acc[R * C + 3];
  for (int i = 0; i < R * C + 3; ++i) acc[i] = vzero();
  const int64_t whole = k / kStep * kStep;
  for (int64_t s = 0; s < whole; s += kStep) {
    if (Prefetch) {
      for (int c = 0; c < C; ++c) __builtin_prefetch(w + (C + c) * ldw + s);
    }
    for (int half = 0; half < 2; ++half) {  // one half at a time: C weight vectors live
      Vec wv[C];
      for (int c = 0; c < C; ++c) {
        wv[c] = load_half(w + c * ldw + s, half);
        pin(wv[c]);
      }
      for (int r = 0; r < R; ++r) {
        Vec av = vload(a + r * lda + s + half * 8);
        pin(av);
        for (int c = 0; c < C; ++c) acc[r * C + c] = vfma(av, wv[c], acc[r * C + c]);
      }
    }
  }
  float sums[R * C + 3];
  for (int i = 0; i < R * C; i += 4) hsum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], sums + i);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float sum = sums[r * C + c];
      for (int64_t i = whole; i < k; ++i) sum += a[r * lda + i] * to_float(w[c * ldw + i]);
      out[r * ldo + c] = sum;
    }
  }
}

// Bytes wanted next (the next weight tile), prefetched into L2 a few lines per tile call
// of the block before, so that its first pass does not wait on memory.
struct Ahead {
  const char* at = nullptr;
  const char* end = nullptr;
  int64_t per_call = 0;
  template <typename T>
  Ahead(const T* begin, int64_t count)
      : at(reinterpret_cast<const char*>(begin)), end(at + count * int64_t(sizeof(T))) {}
  Ahead() = default;
  void step() {
    for (int64_t i = 0; i < per_call && at < end; ++i, at += 64) __builtin_prefetch(at, 0, 2);
  }
};

// The weight rows of a tile of R activation rows (holding P): the most the registers hold.
template <typename P>
constexpr int tile_cols(int R) {
  if (std::is_same_v<P, uint16_t>) return bf16_tile_cols(R);
  return R <= 2 ? 4 : R == 3 ? 3 : 2;
}

// R rows by `cols` weight rows, in the widest tiles the registers hold.
template <int R, bool Prefetch, typename W>
inline void dot_cols(const float* a, int64_t lda, const W* w, int64_t ldw, int64_t k,
                     int64_t cols, float* out, int64_t ldo, Ahead& ahead) {
  constexpr int C = tile_cols<float>(R);
  int64_t c = 0;
  for (; c + C <= cols; c += C) {
    ahead.step();
    dot_tile<R, C, Prefetch>(a, lda, w + c * ldw, ldw, k, out + c, ldo);
  }
  for (; c < cols; ++c) {
    ahead.step();
    dot_tile<R, 1, Prefetch>(a, lda, w + c * ldw, ldw, k, out + c, ldo);
  }
}

template <bool Prefetch, typename W>
inline void dot_rows(const float* a, int64_t lda, int64_t rows, const W* w, int64_t ldw,
                     int64_t cols, int64_t k, float* out, int64_t ldo, Ahead& ahead) {
  switch (rows) {
    case 4: dot_cols<4, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    case 3: dot_cols<3, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    case 2: dot_cols<2, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    case 1: dot_cols<1, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    default: break;
  }
}

// out[r * ldo + c] = a[r] . w[c] for r < rows, c < cols, 4 activation rows at a time: the
// first 4 read the weight rows from memory (prefetching each tile's successor), the others
// from the cache. `ahead` spreads its prefetches over the block. P: float32 rows, or bf16
// rows for the bf16 tiles (their dot_rows overload).
template <typename W, typename P>
inline void dot_block(const P* a, int64_t lda, int64_t rows, const W* w, int64_t ldw,
                      int64_t cols, int64_t k, float* out, int64_t ldo, Ahead ahead = {}) {
  const int64_t tile = tile_cols<P>(int(std::min<int64_t>(rows, 4)));
  const int64_t calls = (rows + 3) / 4 * ((cols + tile - 1) / tile);
  ahead.per_call = ((ahead.end - ahead.at) / 64 + calls - 1) / calls;
  dot_rows<true>(a, lda, std::min<int64_t>(rows, 4), w, ldw, cols, k, out, ldo, ahead);
  for (int64_t r = 4; r < rows; r += 4) {
    dot_rows<false>(a + r * lda, lda, std::min<int64_t>(rows - r, 4), w, ldw, cols, k,
                    out + r * ldo, ldo, ahead);
  }
}

}  // namespace splitserve::dot
