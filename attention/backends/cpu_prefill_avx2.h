// Causal prefill attention over the paged cache with AVX2 + FMA in float32 (part of
// cpu_prefill.cpp): the prefills AMX does not take, on every x86 CPU from AVX2 up. Queries
// of any model dtype, pages of that dtype or fp8, head sizes 64 and 128, any block size,
// with or without a sliding window. As the AMX kernel, every context position is read from
// the cache (this step's K/V were stored first), so fresh prompts, cached prefixes and
// chunked prefills are one case.
//
// Each prefill's context is first widened to float32 once per KV head, the items of a batch
// of prefills sharing it: K transposed (kt[d][key], so that scores are a broadcast-FMA GEMM
// with no lane sums) and V as dense rows. Work item: kPrefillTile query positions of one
// request and one KV head, with the G query heads that share it (rows r = i * G + g):
//   1. S = Q K^T over the keys [from, to) that any row sees, 16 keys outer (their kt columns
//      stay in L1) and 6 rows x 16 keys of accumulators inner;
//   2. an exact softmax per row over the keys it sees (causal, window), the others 0, left
//      unnormalised (1 / sum scales the output);
//   3. O = P V over chunks of 16 KiB of V rows (which stay in L1), 6 rows x 16 dims of
//      accumulators at a time (each V vector loaded once for the 6 rows).
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#if defined(SPLITSERVE_AVX2)

namespace {

constexpr int64_t kPrefillTile = 16;    // query positions per item
constexpr int64_t kWidenedBytes = 64 << 20;  // widened contexts held at once (one at least)

// Keys per K^T row for a context of seq_len: a multiple of 64 plus 16, so that the rows of
// one block of 16 keys (stride * 4 bytes apart) fall in distinct L1 sets; a multiple of
// 4 KiB would put all of them in one set, and pass 1 would read them from L2.
inline int64_t widened_stride(int64_t seq_len) { return (seq_len + 63) / 64 * 64 + 16; }

// K^T [D][stride] and V [stride][D] of one request's context for one KV head, float32 in
// page units (fp8: page_value); K^T zero from seq_len to stride (pass 1 scores whole blocks
// of 16 keys, pass 3 reads no V row past the context).
template <int D, typename C>
void widen_for_prefill(const C* cache, const int32_t* blocks, int64_t seq_len, int64_t kv_head,
                       int64_t stride, const Layout& L, float* kt, float* v) {
  const int64_t row_stride = L.kv_heads * D;
  for (int64_t k = 0; k < seq_len; ++k) {
    const int64_t at = (blocks[k / L.block_size] * L.block_size + k % L.block_size) *
                           row_stride + kv_head * D;
    const C* key = cache + at;
    const C* value = cache + L.cache_half + at;
    for (int d = 0; d < D; ++d) {
      kt[d * stride + k] = page_value(key[d]);
      v[k * D + d] = page_value(value[d]);
    }
  }
  for (int d = 0; d < D; ++d) std::fill(kt + d * stride + seq_len, kt + (d + 1) * stride, 0.0f);
}

// s[r * ld + j] = q[r] . key j, for ROWS rows and the 16 keys whose kt columns start at kt.
template <int D, int ROWS>
inline void score_block(const float* q, const float* kt, int64_t stride, float* s, int64_t ld) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * stride), k1 = _mm256_loadu_ps(kt + d * stride + 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(s + r * ld, acc[r][0]);
    _mm256_storeu_ps(s + r * ld + 8, acc[r][1]);
  }
}

// o[r] += sum over `keys` keys k of p[r * ld + k] * v[k], for ROWS rows of D dims: 16 dims
// of ROWS rows at a time, so that a key's two V vectors are loaded once for all the rows.
template <int D, int ROWS>
inline void accumulate_values(const float* p, int64_t ld, const float* v, int64_t keys, float* o) {
  for (int c = 0; c < D; c += 16) {
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + r * D + c);
      acc[r][1] = _mm256_loadu_ps(o + r * D + c + 8);
    }
    for (int64_t k = 0; k < keys; ++k) {
      const __m256 v0 = _mm256_loadu_ps(v + k * D + c), v1 = _mm256_loadu_ps(v + k * D + c + 8);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * ld + k);
        acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      _mm256_storeu_ps(o + r * D + c, acc[r][0]);
      _mm256_storeu_ps(o + r * D + c + 8, acc[r][1]);
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

// The n (<= kPrefillTile) query positions first_pos.. of one request for one KV head: q and
// out point at the first position's row; kt, v are its widened context (stride keys).
template <int D>
void prefill_tile_avx2(ModelRow q, ModelRow out, int64_t n, int64_t first_pos, int64_t window,
                       int64_t kv_head, const float* kt, const float* v, int64_t stride,
                       float score_scale, float out_scale, const Layout& L,
                       std::vector<float>& work) {
  const int64_t G = L.group, R = n * G, to = first_pos + n;
  const int64_t from = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / 16 * 16 : 0;
  const int64_t width = (to - from + 15) / 16 * 16;
  work.resize(2 * R * D + R * width + R);
  float* qs = work.data();
  float* o = qs + R * D;
  float* s = o + R * D;
  float* inv = s + R * width;
  for (int64_t i = 0; i < n; ++i)
    (q + i * L.q_row_stride + kv_head * G * D).load(G * D, score_scale, qs + i * G * D);
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
    const float sum = splitserve::exp_sum8(row + lo, hi - lo, splitserve::max8(row + lo, hi - lo));
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
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g)
      (out + i * L.out_row_stride + (kv_head * G + g) * D)
          .store(o + (i * G + g) * D, D, inv[i * G + g]);
}

// Every tile of the step's prefills, in batches whose widened contexts fit kWidenedBytes:
// a batch's contexts are widened (items: prefill x KV head), then its tiles run (items:
// tile x KV head), both spread over the threads. k_mul, v_mul: page units to K and V.
template <typename C, int D>
void prefill_all_avx2(ModelRow out, ModelRow q, const at::Tensor& kv_cache,
                      const int32_t* table, const int32_t* lens, const int32_t* starts,
                      const int64_t* req_ids, int64_t num_prefills, double scale,
                      int64_t window, float k_mul, float v_mul, const Layout& L) {
  const C* cache = static_cast<const C*>(kv_cache.data_ptr());
  const float score_scale = static_cast<float>(scale) * k_mul;
  // Kept between calls (every layer of a step asks for the same size).
  static thread_local std::vector<float> widened;
  for (int64_t first = 0; first < num_prefills;) {
    std::vector<int64_t> offsets{0};  // of each prefill of the batch in `widened`
    std::vector<std::pair<int64_t, int64_t>> tiles;  // (prefill, first query row)
    int64_t last = first;
    for (; last < num_prefills; ++last) {
      const int64_t r = req_ids[last], size = L.kv_heads * 2 * D * widened_stride(lens[r]);
      if (last > first && (offsets.back() + size) * 4 > kWidenedBytes) break;
      offsets.push_back(offsets.back() + size);
      for (int64_t row = starts[r]; row < starts[r + 1]; row += kPrefillTile)
        tiles.emplace_back(last, row);
    }
    widened.resize(offsets.back());
    float* wide = widened.data();
    const int64_t num_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < (last - first) * L.kv_heads; ++item) {
        const int64_t p = first + item / L.kv_heads, h = item % L.kv_heads, r = req_ids[p];
        const int64_t stride = widened_stride(lens[r]);
        float* kt = wide + offsets[p - first] + h * 2 * D * stride;
        widen_for_prefill<D>(cache, table + r * L.table_stride, lens[r], h, stride, L, kt,
                             kt + D * stride);
      }
      std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < num_tiles * L.kv_heads; ++item) {
        const auto [p, row] = tiles[item / L.kv_heads];
        const int64_t h = item % L.kv_heads, r = req_ids[p];
        const int64_t stride = widened_stride(lens[r]);
        const int64_t n = std::min<int64_t>(kPrefillTile, starts[r + 1] - row);
        const float* kt = wide + offsets[p - first] + h * 2 * D * stride;
        prefill_tile_avx2<D>(q + row * L.q_row_stride, out + row * L.out_row_stride, n,
                             lens[r] - (starts[r + 1] - row), window, h, kt, kt + D * stride,
                             stride, score_scale, v_mul, L, work);
      }
    }
    first = last;
  }
}

}  // namespace
#endif
