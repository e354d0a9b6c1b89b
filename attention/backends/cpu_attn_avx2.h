// The AVX2 decode path of cpu_attn.cpp (included there, inside its namespace), for float32,
// bf16 and fp16 pages of head sizes that are multiples of 64 (fp8 pages keep the generic
// path). One pass over an item's pages with an online softmax: an item is `heads` KV heads
// of a request (all of them for whole-request items, whose position rows are then read
// whole), taken in chunks of 8 positions:
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
// Pages are widened to float32 as they are loaded.
#pragma once

namespace {

template <typename C, int D>
constexpr bool kAvx2Path = D > 0 && D % 64 == 0 &&
                           (std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16> ||
                            std::is_same_v<C, at::Half>);

#if defined(SPLITSERVE_AVX2)

using splitserve::max_lanes;
using splitserve::widen8;

// Lane t of the result is the sum of the 8 lanes of v[t].
inline __m256 sum_lanes_8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

constexpr int64_t kAheadPositions = 16;

// part[j * 8 + t] = the 8 partial sums of q_j . row t, for the N query heads from q (rows
// D floats apart) that share the row's features at `k`.
template <typename C, int D, int N>
inline void partial_scores(const float* q, const C* k, __m256* part, int t) {
  __m256 a[N];
  for (int j = 0; j < N; ++j) a[j] = _mm256_setzero_ps();
  for (int c = 0; c < D / 8; ++c) {
    const __m256 kv = widen8(k + 8 * c);
    for (int j = 0; j < N; ++j)
      a[j] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + j * D + 8 * c), a[j]);
  }
  for (int j = 0; j < N; ++j) part[j * 8 + t] = a[j];
}

// Row t of the chunk at k, every query head of its `heads` KV heads (G each).
template <typename C, int D>
inline void score_row(const float* qf, const C* k, int64_t heads, int64_t G, __m256* part,
                      int t) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < G; j += 4) {
      const float* q = qf + (h * G + j) * D;
      __m256* out = part + (h * G + j) * 8;
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
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + 64 * part + 8 * c);
    for (int t = 0; t < count; ++t) {
      const __m256 w = _mm256_broadcast_ss(p + t);
      const C* row = v + t * row_stride + 64 * part;
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(w, widen8(row + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + 64 * part + 8 * c, a[c]);
  }
}

// KV heads [kv_head, kv_head + heads) of one request: out rows of their query heads, times
// out_scale.
template <typename C, int D>
void attend_item_avx2(ModelRow q, ModelRow out, const C* cache, const int32_t* blocks,
                      int64_t first, int64_t seq_len, int64_t kv_head, int64_t heads,
                      float scale, const Layout& L, std::vector<float>& work,
                      float out_scale = 1.0f) {
  const int64_t G = L.group, rows = heads * G, row_stride = L.kv_heads * D, bs = L.block_size;
  const int64_t row_bytes = heads * D * int64_t(sizeof(C));
  const int64_t half_bytes = L.cache_half * int64_t(sizeof(C));
  work.resize(rows * (2 * D + 8 + 2 + 64) + 8);
  float* qf = work.data();      // [rows][D] queries times scale
  float* acc = qf + rows * D;   // [rows][D] weighted sums of V rows
  float* p = acc + rows * D;    // [rows][8] the chunk's exp(score - max)
  float* max = p + rows * 8;    // [rows] running max score
  float* sum = max + rows;      // [rows] running sum of exp(score - max)
  auto* part = reinterpret_cast<__m256*>(  // [rows][8] partial sums, 32-byte aligned
      (reinterpret_cast<uintptr_t>(sum + rows) + 31) & ~uintptr_t(31));
  (q + kv_head * G * D).load(rows * D, scale, qf);
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(max, max + rows, -INFINITY);
  std::fill(sum, sum + rows, 0.0f);
  const C* base = cache + kv_head * D;
  auto row = [&](int64_t pos) {  // (pos, kv_head) in kv_cache[0]
    return base + (blocks[pos / bs] * bs + pos % bs) * row_stride;
  };
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
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
      const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps(float(count)), _CMP_LT_OQ);
      for (int64_t r = 0; r < rows; ++r) {
        const __m256 s =
            _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sum_lanes_8(part + r * 8), valid);
        const float top = std::max(max[r], max_lanes(s));
        if (top > max[r]) {
          const float shrink = splitserve::exp_nonpositive(max[r] - top);
          sum[r] *= shrink;
          for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= shrink;
          max[r] = top;
        }
        const __m256 e = splitserve::exp_nonpositive8(_mm256_sub_ps(s, _mm256_set1_ps(top)));
        _mm256_storeu_ps(p + r * 8, e);
        sum[r] += splitserve::sum8(e);
      }
      for (int64_t r = 0; r < rows; ++r)
        add_values<C, D>(acc + r * D, p + r * 8, k + L.cache_half + (r / G) * D, row_stride,
                         count);
      pos += count;
      k += count * row_stride;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    (out + (kv_head * G + r) * D).store(acc + r * D, D, out_scale / sum[r]);
}

#endif

}  // namespace
