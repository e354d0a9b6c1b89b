// The dot-product tiles (dot_tiles.h) for bf16 activations and weights on CPUs with
// AVX-512 BF16 (dot_tiles.h has the float32-math tiles the other ISAs run).
//
// `vdpbf16ps` multiplies 32 bf16 pairs into 16 float32 sums: a step of 32 k is one 64-byte
// load of a weight row and one of a packed activation row, both as they are stored (the
// activations are bf16 already, so packing a row is a copy). A product of two bf16 values
// is exact in float32, as in the float32-math tiles; only the order of the additions
// differs. The k past the last whole step load under a mask (zeros beyond k), and each
// tile ends with 4-at-a-time lane sums. The weight is read once per block of
// 4 activation rows (decode: once), as in dot_tiles.h.
#pragma once

#include "cpu_math.h"

namespace splitserve::dot {

// The weight rows of a tile of R activation rows: the most the 32 registers hold.
constexpr int bf16_tile_cols(int R) { return R <= 2 ? 8 : R == 3 ? 6 : 4; }

}  // namespace splitserve::dot

#if defined(SPLITSERVE_AVX512_BF16)

#include <cstdint>

namespace splitserve::dot {

constexpr int64_t kBf16Step = 32;

// The 16 lanes of each of 4 vectors summed: 4 sums.
inline void hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm512_extractf32x8_ps(abcd, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}

inline __m512bh load_pairs(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
inline __m512bh load_pairs(const uint16_t* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, p));
}

// out[r * ldo + c] = a[r] . w[c] for r < R, c < C; R * C accumulators, C weight vectors
// and one activation vector live in the 32 registers.
template <int R, int C, bool Prefetch>
inline void dot_tile_bf16(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw,
                          int64_t k, float* out, int64_t ldo) {
  constexpr int kAcc = (R * C + 3) / 4 * 4;
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_setzero_ps();
  auto step = [&](int64_t s, auto load) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = load(w + c * ldw + s);
      asm("" : "+v"(wv[c]));  // one load, not one folded into each of the R products
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh av = load(a + r * lda + s);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], av, wv[c]);
    }
  };
  const int64_t whole = k / kBf16Step * kBf16Step;
  for (int64_t s = 0; s < whole; s += kBf16Step) {
    if (Prefetch) {
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + (C + c) * ldw + s),
                                               _MM_HINT_T0);
    }
    step(s, [](const uint16_t* p) { return load_pairs(p); });
  }
  if (whole < k) {
    const __mmask32 mask = _cvtu32_mask32((1u << (k - whole)) - 1);
    step(whole, [mask](const uint16_t* p) { return load_pairs(p, mask); });
  }
  float sums[kAcc];
  for (int i = 0; i < kAcc; i += 4) hsum4_512(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], sums + i);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[r * ldo + c] = sums[r * C + c];
  }
}

// R rows by `cols` weight rows, in the widest tiles the registers hold.
template <int R, bool Prefetch, typename Ahead>
inline void dot_cols_bf16(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw,
                          int64_t k, int64_t cols, float* out, int64_t ldo, Ahead& ahead) {
  constexpr int C = bf16_tile_cols(R);
  int64_t c = 0;
  for (; c + C <= cols; c += C) {
    ahead.step();
    dot_tile_bf16<R, C, Prefetch>(a, lda, w + c * ldw, ldw, k, out + c, ldo);
  }
  for (; c < cols; ++c) {
    ahead.step();
    dot_tile_bf16<R, 1, Prefetch>(a, lda, w + c * ldw, ldw, k, out + c, ldo);
  }
}

// dot_tiles.h's dot_rows for bf16 activation rows.
template <bool Prefetch, typename Ahead>
inline void dot_rows(const uint16_t* a, int64_t lda, int64_t rows, const uint16_t* w,
                          int64_t ldw, int64_t cols, int64_t k, float* out, int64_t ldo,
                          Ahead& ahead) {
  switch (rows) {
    case 4: dot_cols_bf16<4, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    case 3: dot_cols_bf16<3, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    case 2: dot_cols_bf16<2, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    case 1: dot_cols_bf16<1, Prefetch>(a, lda, w, ldw, k, cols, out, ldo, ahead); break;
    default: break;
  }
}

}  // namespace splitserve::dot

#endif
