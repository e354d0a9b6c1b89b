// The AVX2 decode path of cpu_attn.cpp (included there, inside its namespace), for float32,
// bf16 and fp16 pages of head sizes that are multiples of 64 (fp8 pages keep the generic
// path). One pass over an item's pages with an online softmax, so that each page line is
// read from memory once and in address order: an item is `heads` KV heads of a request
// (all of them for whole-request items, whose position rows are then read whole), and per
// chunk of 8 positions
//   1. the scores of every query head of the item, the 8 partial-sum vectors of a head
//      reduced together (no lane sum per position);
//   2. each query head's running max and sum: where the chunk raises the max, the head's
//      sum and V accumulator are scaled down by exp(old - new) first;
//   3. the chunk's V rows, weighted by exp(score - max), added into the query heads'
//      accumulators (64 features at a time in 8 registers; the rows stay in L1 across the
//      G query heads that share them).
// Pages are widened to float32 as they are loaded.
#pragma once

namespace {

template <typename C, int D>
constexpr bool kAvx2Path = D > 0 && D % 64 == 0 &&
                           (std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16> ||
                            std::is_same_v<C, at::Half>);

#if defined(SPLITSERVE_AVX2)

// 8 consecutive page values as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return splitserve::bf16x8_to_float(reinterpret_cast<const uint16_t*>(p));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lane t of the result is the sum of the 8 lanes of v[t].
inline __m256 sum_lanes_8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Rows this many positions ahead are prefetched while a chunk is computed: one prefetch
// per line loaded, spread through the arithmetic (bursts of prefetches at block starts
// stall the loads queued behind them and gained nothing).
constexpr int64_t kAheadPositions = 32;

// Prefetches the line of each of the 8 rows at `ahead[t] + offset` when the c-th group of 8
// values of a row starts a line.
template <typename C, int c>
inline void prefetch_rows(const C* const* ahead, int64_t offset) {
  if constexpr (8 * c * sizeof(C) % 64 == 0)
    for (int t = 0; t < 8; ++t) prefetch_line(reinterpret_cast<const char*>(ahead[t] + offset));
}

// The scores of query row qf (times the softmax scale) against rows[t] + offset for
// t < count (<= 8; rows from count on repeat the last); lanes from count on are -inf. The
// 8 sums are independent chains, so the FMAs overlap instead of waiting on each other.
// ahead: rows to prefetch (at the same offset), or null.
template <typename C, int D>
inline __m256 scores8(const float* qf, const C* const* rows, int64_t offset, int count,
                      const C* const* ahead) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  [&]<int... c>(std::integer_sequence<int, c...>) {
    ([&] {
      if (ahead) prefetch_rows<C, c>(ahead, offset + 8 * c);
      const __m256 qv = _mm256_loadu_ps(qf + 8 * c);
      for (int t = 0; t < 8; ++t)
        acc[t] = _mm256_fmadd_ps(load8(rows[t] + offset + 8 * c), qv, acc[t]);
    }(), ...);
  }(std::make_integer_sequence<int, D / 8>{});
  const __m256 valid = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                     _mm256_set1_ps(float(count)), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sum_lanes_8(acc), valid);
}

// acc[0..D) += sum over t < count of p[t] * (rows[t] + offset)[0..D); ahead as scores8.
template <typename C, int D>
inline void add_values8(float* acc, const float* p, const C* const* rows, int64_t offset,
                        int count, const C* const* ahead) {
  for (int part = 0; part < D / 64; ++part) {
    const int64_t at = offset + 64 * part;
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + 64 * part + 8 * c);
    if (ahead)
      [&]<int... c>(std::integer_sequence<int, c...>) {
        (prefetch_rows<C, c>(ahead, at + 8 * c), ...);
      }(std::make_integer_sequence<int, 8>{});
    for (int t = 0; t < count; ++t) {
      const __m256 w = _mm256_broadcast_ss(p + t);
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(w, load8(rows[t] + at + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + 64 * part + 8 * c, a[c]);
  }
}

// KV heads [kv_head, kv_head + heads) of one request: out rows of their query heads.
template <typename T, typename C, int D>
void attend_item_avx2(const T* q, T* out, const C* cache, const int32_t* blocks, int64_t first,
                      int64_t seq_len, int64_t kv_head, int64_t heads, float scale,
                      const Layout& L, std::vector<float>& work) {
  const int64_t G = L.group, rows = heads * G, row_stride = L.kv_heads * D, bs = L.block_size;
  work.resize(rows * (2 * D + 10));
  float* qf = work.data();      // [rows][D] queries times scale
  float* acc = qf + rows * D;   // [rows][D] weighted sums of V rows
  float* p = acc + rows * D;    // [rows][8] the chunk's exp(score - max)
  float* max = p + rows * 8;    // [rows] running max score
  float* sum = max + rows;      // [rows] running sum of exp(score - max)
  const T* q0 = q + kv_head * G * D;
  for (int64_t i = 0; i < rows * D; ++i) qf[i] = to_float(q0[i]) * scale;
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(max, max + rows, -INFINITY);
  std::fill(sum, sum + rows, 0.0f);
  const C* base = cache + kv_head * D;  // (block b, offset o): base + (b * bs + o) * row_stride
  const C* k[8];
  const C* ahead[8];
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t end = std::min(seq_len, (pos / bs + 1) * bs);
    const C* block_k = base + (blocks[pos / bs] * bs + pos % bs) * row_stride;
    for (; pos < end;) {
      const int count = static_cast<int>(std::min<int64_t>(8, end - pos));
      for (int t = 0; t < 8; ++t) k[t] = block_k + std::min(t, count - 1) * row_stride;
      const int64_t next = pos + kAheadPositions;
      const bool prefetch = next < seq_len;
      if (prefetch)
        for (int64_t t = 0, b = next / bs, o = next % bs; t < 8; ++t) {
          ahead[t] = base + (blocks[b] * bs + o) * row_stride;
          if (next + t + 1 < seq_len && ++o == bs) ++b, o = 0;
        }
      for (int64_t r = 0; r < rows; ++r) {
        const bool first_of_head = r % G == 0;
        const __m256 s = scores8<C, D>(qf + r * D, k, (r / G) * D, count,
                                       prefetch && first_of_head ? ahead : nullptr);
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
        add_values8<C, D>(acc + r * D, p + r * 8, k, L.cache_half + (r / G) * D, count,
                          prefetch && r % G == 0 ? ahead : nullptr);
      pos += count;
      block_k += count * row_stride;
    }
  }
  T* o = out + kv_head * G * D;
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / sum[r];
    for (int64_t d = 0; d < D; ++d) o[r * D + d] = static_cast<T>(acc[r * D + d] * inv);
  }
}

#endif

}  // namespace
