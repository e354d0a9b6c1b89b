// Causal prefill attention over the paged cache in float32 (part of cpu_prefill.cpp): the
// prefills AMX does not take, on x86 builds from AVX2 up and Arm ones. Queries of any model
// dtype, pages of that dtype or fp8, head sizes 64 and 128, any block size, with or without
// a sliding window. As the AMX kernel, every context position is read from the cache (this
// step's K/V were stored first), so fresh prompts, cached prefixes and chunked prefills are
// one case.
//
// Each prefill's context is first widened to float32 once per KV head, the items of a batch
// of prefills sharing it: K transposed (kt[d][key], so that scores are a broadcast-FMA GEMM
// with no lane sums) and V as dense rows. Work item: kPrefillTile query positions of one
// request and one KV head, with the G query heads that share it, computed by
// cpu_prefill_vec8.h.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "cpu_prefill_vec8.h"

#if defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)

namespace {

constexpr int64_t kWidenedBytes = 64 << 20;  // widened contexts held at once (one at least)

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

// prefill_tile_vec8 on one tile: its query rows read times score_scale, its output rows
// written times the tile's inv.
template <int D>
void prefill_tile(ModelRow q, ModelRow out, int64_t n, int64_t first_pos, int64_t window,
                  int64_t kv_head, const float* kt, const float* v, int64_t stride,
                  float score_scale, float out_scale, const Layout& L, std::vector<float>& work) {
  const int64_t G = L.group, R = n * G;
  int64_t from;
  const int64_t width = prefill_width(n, first_pos, window, &from);
  work.resize(2 * R * D + R * width + R);
  float* qs = work.data();
  float* o = qs + R * D;
  float* s = o + R * D;
  float* inv = s + R * width;
  for (int64_t i = 0; i < n; ++i)
    (q + i * L.q_row_stride + kv_head * G * D).load(G * D, score_scale, qs + i * G * D);
  prefill_tile_vec8<D>(qs, n, first_pos, window, G, kt, v, stride, out_scale, o, inv, s);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g)
      (out + i * L.out_row_stride + (kv_head * G + g) * D)
          .store(o + (i * G + g) * D, D, inv[i * G + g]);
}

// Every tile of the step's prefills, in batches whose widened contexts fit kWidenedBytes:
// a batch's contexts are widened (items: prefill x KV head), then its tiles run (items:
// tile x KV head), both spread over the threads. k_mul, v_mul: page units to K and V.
template <typename C, int D>
void prefill_all_vec8(ModelRow out, ModelRow q, const at::Tensor& kv_cache,
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
        prefill_tile<D>(q + row * L.q_row_stride, out + row * L.out_row_stride, n,
                        lens[r] - (starts[r + 1] - row), window, h, kt, kt + D * stride, stride,
                        score_scale, v_mul, L, work);
      }
    }
    first = last;
  }
}

}  // namespace

#endif
