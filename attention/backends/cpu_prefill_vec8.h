// The float32 core of the prefill attention kernel (cpu_prefill_widened.h), on 8-lane
// vectors (kernels/cpu_vec8.h: AVX2 builds and Arm ones): one tile of query positions over a
// request's context widened to K^T and V rows. No torch headers:
// tests/kernels/test_neon_attention.py builds it for aarch64 and runs it in an emulator
// against the AVX2 build, bitwise.
//   1. S = Q K^T over the keys [from, to) that any row sees, 16 keys outer (their kt columns
//      stay in L1) and 6 rows x 16 keys of accumulators inner;
//   2. an exact softmax per row over the keys it sees (causal, window), the others 0, left
//      unnormalised (1 / sum scales the output);
//   3. O = P V over chunks of 16 KiB of V rows (which stay in L1), 6 rows x 16 dims of
//      accumulators at a time (each V vector loaded once for the 6 rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_vec8.h"

#if defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)

namespace {

using splitserve::exp_sum8;
using splitserve::fmadd8;
using splitserve::load8;
using splitserve::max8;
using splitserve::set8;
using splitserve::store8;
using splitserve::V8;
using splitserve::zero8;

constexpr int64_t kPrefillTile = 16;  // query positions per item

// Keys per K^T row for a context of seq_len: a multiple of 64 plus 16, so that the rows of
// one block of 16 keys (stride * 4 bytes apart) fall in distinct L1 sets; a multiple of
// 4 KiB would put all of them in one set, and pass 1 would read them from L2.
inline int64_t widened_stride(int64_t seq_len) { return (seq_len + 63) / 64 * 64 + 16; }

// s[r * ld + j] = q[r] . key j, for ROWS rows and the 16 keys whose kt columns start at kt.
template <int D, int ROWS>
inline void score_block(const float* q, const float* kt, int64_t stride, float* s, int64_t ld) {
  V8 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = zero8();
  for (int d = 0; d < D; ++d) {
    const V8 k0 = load8(kt + d * stride), k1 = load8(kt + d * stride + 8);
    for (int r = 0; r < ROWS; ++r) {
      const V8 x = set8(q[r * D + d]);
      acc[r][0] = fmadd8(x, k0, acc[r][0]);
      acc[r][1] = fmadd8(x, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    store8(s + r * ld, acc[r][0]);
    store8(s + r * ld + 8, acc[r][1]);
  }
}

// o[r] += sum over `keys` keys k of p[r * ld + k] * v[k], for ROWS rows of D dims: 16 dims
// of ROWS rows at a time, so that a key's two V vectors are loaded once for all the rows.
template <int D, int ROWS>
inline void accumulate_values(const float* p, int64_t ld, const float* v, int64_t keys, float* o) {
  for (int c = 0; c < D; c += 16) {
    V8 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = load8(o + r * D + c);
      acc[r][1] = load8(o + r * D + c + 8);
    }
    for (int64_t k = 0; k < keys; ++k) {
      const V8 v0 = load8(v + k * D + c), v1 = load8(v + k * D + c + 8);
      for (int r = 0; r < ROWS; ++r) {
        const V8 w = set8(p[r * ld + k]);
        acc[r][0] = fmadd8(w, v0, acc[r][0]);
        acc[r][1] = fmadd8(w, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      store8(o + r * D + c, acc[r][0]);
      store8(o + r * D + c + 8, acc[r][1]);
    }
  }
}

// f(std::integral_constant<int, n>) for 1 <= n <= Max: the row tails of a micro-kernel.
template <int Max, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (Max > 1)
    if (n < Max) return with_rows<Max - 1>(n, f);
  f(std::integral_constant<int, Max>{});
}

// The keys a tile of n query positions from first_pos sees start at *from (a multiple of
// 16); returns how many keys its score rows hold from there (a multiple of 16).
inline int64_t prefill_width(int64_t n, int64_t first_pos, int64_t window, int64_t* from) {
  *from = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / 16 * 16 : 0;
  return (first_pos + n - *from + 15) / 16 * 16;
}

// The n (<= kPrefillTile) query positions first_pos.. of one request for one KV head, with
// the G query heads that share it (rows r = i * G + g): qs [n * G][D] the queries times the
// score scale, kt, v its widened context (stride keys). o [n * G][D] gets each row's
// softmax-weighted V rows, unnormalised, and inv [n * G] out_scale / the weights' sum (the
// output row is o times inv); s holds the scores, n * G rows of prefill_width floats.
template <int D>
void prefill_tile_vec8(const float* qs, int64_t n, int64_t first_pos, int64_t window,
                       int64_t G, const float* kt, const float* v, int64_t stride,
                       float out_scale, float* o, float* inv, float* s) {
  const int64_t R = n * G, to = first_pos + n;
  int64_t from;
  const int64_t width = prefill_width(n, first_pos, window, &from);
  for (int64_t key = 0; key < width; key += 16)
    for (int64_t r = 0; r < R; r += 6)
      with_rows<6>(R - r, [&](auto rows) {
        score_block<D, decltype(rows)::value>(qs + r * D, kt + from + key, stride,
                                              s + r * width + key, width);
      });
  for (int64_t r = 0; r < R; ++r) {
    const int64_t pos = first_pos + r / G;
    const int64_t lo = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - from;
    const int64_t hi = pos + 1 - from;
    float* row = s + r * width;
    const float sum = exp_sum8(row + lo, hi - lo, max8(row + lo, hi - lo));
    std::fill(row, row + lo, 0.0f);
    std::fill(row + hi, row + (to - from), 0.0f);
    inv[r] = out_scale / sum;
  }
  std::fill(o, o + R * D, 0.0f);
  constexpr int64_t kChunk = 4096 / D;  // keys of 16 KiB of V rows
  for (int64_t key = from; key < to; key += kChunk) {
    const int64_t keys = std::min(kChunk, to - key);
    for (int64_t r = 0; r < R; r += 6)
      with_rows<6>(R - r, [&](auto rows) {
        accumulate_values<D, decltype(rows)::value>(s + r * width + key - from, width,
                                                    v + key * D, keys, o + r * D);
      });
  }
}

}  // namespace

#endif
