// Causal prefill attention over the paged cache with AMX, for bf16 (part of cpu_prefill.cpp).
// Each request's queries attend to its context's first seq_len positions, all already in the
// cache (this step's K/V were stored first), so fresh prompts, cached prefixes and chunked
// prefills are one case.
//
// Work item: (request, query head, tile of 16 query rows). Three passes, all in L1/L2:
//   1. S^T = K . Q^T per chunk of 16 keys: A = K rows read in place from their page,
//      B = the tile's Q^T in bf16 pairs, C = [16 keys x 16 queries] fp32;
//   2. an exact softmax per query (lane) over its visible keys, into bf16 pairs
//      (transformers' eager attention casts probabilities to the value dtype too);
//   3. O^T = V^T . P^T per 16 dims, over chunks of 32 keys: A = V^T rows (transposed once
//      per request and KV head, before the items run), B = the pairs of pass 2.
// fp8 pages (bf16 queries) are widened to bf16 once per request and KV head, before the
// items run: V into V^T as above, K into dense rows that pass 1 reads instead of the pages
// (exact: every fp8 value is a bf16); the layer's scales scale the scores and the output.
#pragma once

#include <utility>
#include <vector>

#if defined(SPLITSERVE_AMX)

namespace {

using splitserve::exp_nonpositive16;
using splitserve::load_tile_config;
using splitserve::pair_rows;
using splitserve::TileConfig;

// tmm0 = scores, tmm1 = A operand, tmm2 = B operand, tmm3..tmm6 = four output tiles;
// every tile 16 rows of 64 bytes.
inline void configure_prefill_tiles() {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  load_tile_config(config);
}

// r[j] becomes column j of the 16 x 16 matrix whose rows were r[0..15].
inline void transpose16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

struct PrefillLayout {
  int64_t block_size, kv_heads, group, q_row_stride, out_row_stride, table_stride, cache_half;
  int64_t vt_stride;  // keys per V^T row (the longest context, rounded up to 32)
};

// A page element's bf16 bits: bf16 pages' own, fp8 pages' value in page units.
template <typename C>
inline uint16_t bf16_page_bits(C x) {
  if constexpr (kIsFp8<C>) {
    const float f = page_value(x);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return uint16_t(bits >> 16);
  } else {
    return x;
  }
}

// V^T of one request and KV head: vt[d * vt_stride + k] = V[k][d], zero past seq_len.
template <int D, typename C>
void transpose_values(const C* values, const int32_t* blocks, int64_t seq_len,
                      int64_t kv_head, const PrefillLayout& L, uint16_t* vt) {
  const int64_t row_stride = L.kv_heads * D;
  for (int64_t k = 0; k < seq_len; ++k) {
    const C* v = values + (blocks[k / L.block_size] * L.block_size + k % L.block_size) *
                              row_stride + kv_head * D;
    for (int64_t d = 0; d < D; ++d) vt[d * L.vt_stride + k] = bf16_page_bits(v[d]);
  }
  const int64_t padded = (seq_len + 31) / 32 * 32;
  for (int64_t d = 0; d < D; ++d)
    std::fill(vt + d * L.vt_stride + seq_len, vt + d * L.vt_stride + padded, uint16_t{0});
}

// K rows of one request and KV head as dense bf16 rows: kd[k * D + d] = K[k][d], zero
// from seq_len to the next multiple of 32.
template <int D, typename C>
void widen_keys(const C* keys, const int32_t* blocks, int64_t seq_len, int64_t kv_head,
                const PrefillLayout& L, uint16_t* kd) {
  const int64_t row_stride = L.kv_heads * D;
  for (int64_t k = 0; k < seq_len; ++k) {
    const C* row = keys + (blocks[k / L.block_size] * L.block_size + k % L.block_size) *
                              row_stride + kv_head * D;
    for (int64_t d = 0; d < D; ++d) kd[k * D + d] = bf16_page_bits(row[d]);
  }
  std::fill(kd + seq_len * D, kd + (seq_len + 31) / 32 * 32 * D, uint16_t{0});
}

// Query rows q_rows[0..n) (n <= 16) of head `head`, at positions first_pos + i. K rows are
// read from the pages by `blocks`, or where blocks is null from `keys` as dense rows of
// this KV head (widen_keys). The output is scaled by out_scale.
template <int D>
void prefill_tile(const uint16_t* q, uint16_t* out, int64_t n, int64_t first_pos,
                  const uint16_t* keys, const uint16_t* vt, const int32_t* blocks, int64_t head,
                  float scale, float out_scale, const PrefillLayout& L,
                  std::vector<float>& work) {
  const int64_t kv_head = head / L.group, row_stride = L.kv_heads * D;
  const int64_t key_stride = blocks ? row_stride : D;
  const int64_t num_keys = first_pos + n, padded = (num_keys + 31) / 32 * 32;
  // work: scores [padded x 16] fp32 | P^T pairs [padded / 2 x 16] | Q^T pairs [D/32][16 x 16]
  work.resize(padded * 16 + padded * 8 + D * 8);
  float* scores = work.data();
  auto* p_pairs = reinterpret_cast<uint32_t*>(scores + padded * 16);
  auto* q_tiles = reinterpret_cast<uint32_t*>(scores + padded * 24);
  for (int64_t c = 0; c < D / 32; ++c) {  // tile c, row r, column i: word 16c + r of query i
    __m512 words[16];
    for (int64_t i = 0; i < 16; ++i)
      words[i] = _mm512_loadu_ps(q + std::min(i, n - 1) * L.q_row_stride + head * D + 32 * c);
    transpose16x16(words);
    for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps(q_tiles + (c * 16 + r) * 16, words[r]);
  }
  for (int64_t start = 0; start < num_keys; start += 16) {
    const uint16_t* k = blocks ? keys + (blocks[start / L.block_size] * L.block_size +
                                         start % L.block_size) * row_stride + kv_head * D
                               : keys + start * D;
    _tile_zero(0);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(1, k + 32 * c, key_stride * 2);
      _tile_loadd(2, q_tiles + c * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, scores + start * 16, 64);
  }
  // Key k is visible to query lane i when k <= first_pos + i.
  const __m512i lane_pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_pos)),
                                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                             5, 4, 3, 2, 1, 0));
  auto visible = [&](int64_t key) {
    return _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int>(key)), lane_pos,
                                 _MM_CMPINT_LE);
  };
  const __m512 vscale = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
  __m512 max = minus_inf;
  for (int64_t key = 0; key < num_keys; ++key) {
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scores + key * 16), vscale);
    max = _mm512_mask_max_ps(max, visible(key), max, s);
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t key = 0; key < padded; key += 2) {
    __m512 p[2];
    for (int j = 0; j < 2; ++j) {
      const int64_t kk = key + j;
      const __mmask16 m = kk < num_keys ? visible(kk) : __mmask16{0};
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scores + kk * 16), vscale);
      p[j] = _mm512_maskz_mov_ps(m, exp_nonpositive16(_mm512_sub_ps(s, max)));
      sum = _mm512_add_ps(sum, p[j]);
    }
    _mm512_storeu_si512(p_pairs + key * 8, pair_rows(p[0], p[1]));
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(out_scale), sum));
  alignas(64) float o[16 * 16];
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    for (int64_t key = 0; key < padded; key += 32) {
      _tile_loadd(2, p_pairs + key * 8, 64);
      _tile_loadd(1, vt + (d0 + 0) * L.vt_stride + key, L.vt_stride * 2);
      _tile_dpbf16ps(3, 1, 2);
      _tile_loadd(1, vt + (d0 + 16) * L.vt_stride + key, L.vt_stride * 2);
      _tile_dpbf16ps(4, 1, 2);
      _tile_loadd(1, vt + (d0 + 32) * L.vt_stride + key, L.vt_stride * 2);
      _tile_dpbf16ps(5, 1, 2);
      _tile_loadd(1, vt + (d0 + 48) * L.vt_stride + key, L.vt_stride * 2);
      _tile_dpbf16ps(6, 1, 2);
    }
    for (int t = 0; t < 4; ++t) {
      switch (t) {  // tile ids must be immediates
        case 0:
          _tile_stored(3, o, 64);
          break;
        case 1:
          _tile_stored(4, o, 64);
          break;
        case 2:
          _tile_stored(5, o, 64);
          break;
        default:
          _tile_stored(6, o, 64);
      }
      __m512 rows[16];  // o is [16 dims x 16 queries]: transposed, a query per vector
      for (int64_t d = 0; d < 16; ++d) rows[d] = _mm512_load_ps(o + d * 16);
      transpose16x16(rows);
      for (int64_t i = 0; i < n; ++i) {
        const __m512 scaled = _mm512_mul_ps(rows[i], _mm512_set1_ps(inv[i]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * L.out_row_stride + head * D +
                                                       d0 + 16 * t),
                            (__m256i)_mm512_cvtneps_pbh(scaled));
      }
    }
  }
}

// Every tile of the step's prefills: V^T (and for fp8 pages dense K rows) of each prefill
// and KV head first, then the (tile, head) items.
template <typename C>
void prefill_all(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                 const at::Tensor& block_table, const int32_t* lens, const int32_t* starts,
                 const int64_t* req_ids, int64_t num_prefills, double scale, double k_scale,
                 double v_scale) {
  const int64_t kv_heads = kv_cache.size(3), dim = kv_cache.size(4), heads = q.size(1);
  int64_t longest = 32;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (prefill index, first query row)
  for (int64_t p = 0; p < num_prefills; ++p) {
    const int64_t r = req_ids[p];
    longest = std::max<int64_t>(longest, lens[r]);
    for (int64_t row = starts[r]; row < starts[r + 1]; row += 16) tiles.emplace_back(p, row);
  }
  const PrefillLayout L{kv_cache.size(2),  kv_heads,      heads / kv_heads, q.stride(0),
                        out.stride(0),     block_table.stride(0), kv_cache.stride(0),
                        (longest + 31) / 32 * 32};
  // V^T (and dense K) of every prefill and KV head, kept between a thread's calls (every
  // layer of a step asks for the same size), so that no layer maps and unmaps megabytes.
  static thread_local std::vector<uint16_t> vt, kd;
  const int64_t widened = num_prefills * kv_heads * dim * L.vt_stride;
  vt.resize(widened);
  kd.resize(kIsFp8<C> ? widened : 0);
  const C* cache = static_cast<const C*>(kv_cache.data_ptr());
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr());
  uint16_t* vt_ptr = vt.data();
  uint16_t* kd_ptr = kd.data();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * heads;
  const float unit = kPageUnit<C>;
  const float score_scale = float(scale) * (kIsFp8<C> ? float(k_scale) * unit : 1.0f);
  const float out_scale = kIsFp8<C> ? float(v_scale) * unit : 1.0f;
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_prefills * kv_heads; ++item) {
      const int64_t p = item / kv_heads, h = item % kv_heads, r = req_ids[p];
      uint16_t* dst = vt_ptr + item * dim * L.vt_stride;
      const int32_t* blocks = table + r * L.table_stride;
      if (dim == 64)
        transpose_values<64>(cache + L.cache_half, blocks, lens[r], h, L, dst);
      else
        transpose_values<128>(cache + L.cache_half, blocks, lens[r], h, L, dst);
      if constexpr (kIsFp8<C>) {
        uint16_t* keys = kd_ptr + item * dim * L.vt_stride;
        if (dim == 64)
          widen_keys<64>(cache, blocks, lens[r], h, L, keys);
        else
          widen_keys<128>(cache, blocks, lens[r], h, L, keys);
      }
    }
    configure_prefill_tiles();
    std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const auto [p, row] = tiles[item / heads];
      const int64_t head = item % heads, r = req_ids[p];
      const int64_t n = std::min<int64_t>(16, starts[r + 1] - row);
      const int64_t first_pos = lens[r] - (starts[r + 1] - row);
      const int64_t widened_at = (p * kv_heads + head / L.group) * dim * L.vt_stride;
      const uint16_t* v_t = vt_ptr + widened_at;
      const int32_t* blocks = table + r * L.table_stride;
      const uint16_t* keys = reinterpret_cast<const uint16_t*>(cache);
      if constexpr (kIsFp8<C>) {
        keys = kd_ptr + widened_at;
        blocks = nullptr;
      }
      const uint16_t* q_rows = q_ptr + row * L.q_row_stride;
      uint16_t* out_rows = out_ptr + row * L.out_row_stride;
      if (dim == 64)
        prefill_tile<64>(q_rows, out_rows, n, first_pos, keys, v_t, blocks, head, score_scale,
                         out_scale, L, work);
      else
        prefill_tile<128>(q_rows, out_rows, n, first_pos, keys, v_t, blocks, head, score_scale,
                          out_scale, L, work);
    }
    _tile_release();
  }
}

}  // namespace
#endif
