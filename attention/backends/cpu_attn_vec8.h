// The vectorised decode path of cpu_attn.cpp, on 8-lane vectors (kernels/cpu_vec8.h: AVX2
// builds and Arm ones), for float32, bf16 and fp16 pages of head sizes that are multiples
// of 64 (fp8 pages keep the generic path). One pass over an item's pages with an online
// softmax: an item is `heads` KV heads of a request (all of them for whole-request items,
// whose position rows are then read whole), taken in chunks of 8 positions:
//   1. scores: the chunk's K rows in address order, each row's features loaded once for
//      the G query heads that share them, 8 partial-sum vectors per (query head, row)
//      reduced together per query head (no lane sum per position). Lines read in address
//      order stream from memory faster than the same lines read head by head (SmolLM2's
//      float32 rows, 768 B: 17.5 against 11 GB/s on a Zen 4, loads alone), whose misses
//      come in a stride the prefetchers follow poorly; the rows kAheadPositions ahead
//      are prefetched as each row is scored;
//   2. each query head's running max and sum: where the chunk raises the max, the head's
//      sum and V accumulator are scaled down by exp(old - new) first;
//   3. values: per query head, its V features of the chunk's rows, weighted by
//      exp(score - max), added into 64 accumulator features held in 8 registers.
// Pages are widened to float32 as they are loaded. Plain C++ on the vectors and the page
// layout (cpu_attn_pages.h), no torch headers: tests/kernels/test_neon_attention.py builds
// it for aarch64 and runs it in an emulator against the AVX2 build, bitwise.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_attn_pages.h"
#include "cpu_vec8.h"

namespace {

template <typename C, int D>
constexpr bool kVec8Path = D > 0 && D % 64 == 0 &&
                           (std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16> ||
                            std::is_same_v<C, c10::Half>);

#if defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)

using splitserve::fmadd8;
using splitserve::lanes_below;
using splitserve::load8;
using splitserve::M8;
using splitserve::max_lanes;
using splitserve::select8;
using splitserve::set8;
using splitserve::store8;
using splitserve::sub8;
using splitserve::sum_each8;
using splitserve::V8;
using splitserve::widen8;
using splitserve::zero8;

constexpr int64_t kAheadPositions = 16;

// part[j * 8 + t] = the 8 partial sums of q_j . row t, for the N query heads from q (rows
// D floats apart) that share the row's features at `k`.
template <typename C, int D, int N>
inline void partial_scores(const float* q, const C* k, V8* part, int t) {
  V8 a[N];
  for (int j = 0; j < N; ++j) a[j] = zero8();
  for (int c = 0; c < D / 8; ++c) {
    const V8 kv = widen8(k + 8 * c);
    for (int j = 0; j < N; ++j) a[j] = fmadd8(kv, load8(q + j * D + 8 * c), a[j]);
  }
  for (int j = 0; j < N; ++j) part[j * 8 + t] = a[j];
}

// Row t of the chunk at k, every query head of its `heads` KV heads (G each).
template <typename C, int D>
inline void score_row(const float* qf, const C* k, int64_t heads, int64_t G, V8* part, int t) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < G; j += 4) {
      const float* q = qf + (h * G + j) * D;
      V8* out = part + (h * G + j) * 8;
      switch (std::min<int64_t>(4, G - j)) {
        case 1: partial_scores<C, D, 1>(q, k + h * D, out, t); break;
        case 2: partial_scores<C, D, 2>(q, k + h * D, out, t); break;
        case 3: partial_scores<C, D, 3>(q, k + h * D, out, t); break;
        default: partial_scores<C, D, 4>(q, k + h * D, out, t); break;
      }
    }
}

// acc[0..D) += sum over t < count of p[t] * v row t (rows row_stride apart).
template <typename C, int D>
inline void add_values(float* acc, const float* p, const C* v, int64_t row_stride, int count) {
  for (int part = 0; part < D / 64; ++part) {
    V8 a[8];
    for (int c = 0; c < 8; ++c) a[c] = load8(acc + 64 * part + 8 * c);
    for (int t = 0; t < count; ++t) {
      const V8 w = set8(p[t]);
      const C* row = v + t * row_stride + 64 * part;
      for (int c = 0; c < 8; ++c) a[c] = fmadd8(w, widen8(row + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) store8(acc + 64 * part + 8 * c, a[c]);
  }
}

// Floats of work attend_vec8 takes for `rows` query heads.
constexpr int64_t vec8_work_floats(int64_t rows) { return rows * (8 + 1 + 64) + 8; }

// KV heads [kv_head, kv_head + heads) of one request, the rows = heads * G query heads of
// qf [rows][D] (queries times the scale): acc [rows][D] gets each query head's V rows
// weighted by exp(score - max), sum [rows] those weights' sums (its output is acc / sum).
template <typename C, int D>
void attend_vec8(const float* qf, float* acc, float* sum, const C* cache, const int32_t* blocks,
                 int64_t first, int64_t seq_len, int64_t kv_head, int64_t heads, const Layout& L,
                 float* work) {
  const int64_t G = L.group, rows = heads * G, row_stride = L.kv_heads * D, bs = L.block_size;
  const int64_t row_bytes = heads * D * int64_t(sizeof(C));
  const int64_t half_bytes = L.cache_half * int64_t(sizeof(C));
  float* p = work;              // [rows][8] the chunk's exp(score - max)
  float* max = p + rows * 8;    // [rows] running max score
  auto* part = reinterpret_cast<V8*>(  // [rows][8] partial sums, 32-byte aligned
      (reinterpret_cast<uintptr_t>(max + rows) + 31) & ~uintptr_t(31));
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(max, max + rows, -INFINITY);
  std::fill(sum, sum + rows, 0.0f);
  const C* base = cache + kv_head * D;
  auto row = [&](int64_t pos) {  // (pos, kv_head) in kv_cache[0]
    return base + (blocks[pos / bs] * bs + pos % bs) * row_stride;
  };
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t end = std::min(seq_len, (pos / bs + 1) * bs);
    for (const C* k = row(pos); pos < end;) {
      const int count = static_cast<int>(std::min<int64_t>(8, end - pos));
      for (int t = 0; t < count; ++t) {
        if (pos + t + kAheadPositions < seq_len) {
          const char* line = reinterpret_cast<const char*>(row(pos + t + kAheadPositions));
          for (int64_t b = 0; b < row_bytes; b += 64) {
            prefetch_line(line + b);
            prefetch_line(line + b + half_bytes);
          }
        }
        score_row<C, D>(qf, k + t * row_stride, heads, G, part, t);
      }
      // Lanes from count on hold an earlier chunk's sums (or nothing): -inf.
      const M8 valid = lanes_below(count);
      for (int64_t r = 0; r < rows; ++r) {
        const V8 s = select8(valid, sum_each8(part + r * 8), set8(-INFINITY));
        const float top = std::max(max[r], max_lanes(s));
        if (top > max[r]) {
          const float shrink = splitserve::exp_nonpositive(max[r] - top);
          sum[r] *= shrink;
          for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= shrink;
          max[r] = top;
        }
        const V8 e = splitserve::exp_nonpositive8(sub8(s, set8(top)));
        store8(p + r * 8, e);
        sum[r] += splitserve::sum8(e);
      }
      for (int64_t r = 0; r < rows; ++r)
        add_values<C, D>(acc + r * D, p + r * 8, k + L.cache_half + (r / G) * D, row_stride,
                         count);
      pos += count;
      k += count * row_stride;
    }
  }
}

#endif

}  // namespace
