// The AMX decode path of cpu_attn.cpp (included there, inside its namespace), used for
// bf16 caches where the CPU has AMX-BF16 and blocks hold a multiple of 16 positions: one
// pass over a context in chunks of 16 positions, with an online softmax. Per chunk, AMX
// computes the scores, the softmax runs across all query heads at once, and VDPBF16PS
// adds the chunk's probability-weighted V rows two positions at a time, while the K and V
// lines of the next block are requested a few at a time all through the chunk (a burst
// of them would stall the core on its 16 line-fill buffers).
#pragma once

#if defined(SPLITSERVE_AMX)
#include <cmath>

namespace {

// The K and V lines of a future block, requested a few at a time between positions so
// that the line-fill buffers stay busy while the arithmetic runs.
struct PrefetchStream {
  const char *k = nullptr, *v = nullptr;
  int64_t bytes = 0, next = 0, per_step = 0;
  inline void step() {
    for (int64_t i = 0; i < per_step && next < bytes; ++i, next += 64) {
      prefetch_line(k + next);
      prefetch_line(v + next);
    }
  }
};

// Blocks the next chunk's prefetches reach ahead (measured: 1 beats 2 and 4 here).
constexpr int64_t kAmxPrefetchBlocks = 1;

using splitserve::amx_usable;
using splitserve::exp_nonpositive16;
using splitserve::pair_rows;
using splitserve::load_tile_config;
using splitserve::TileConfig;

// Tiles of the score product S = K . Q^T of one 16-position chunk and one KV head:
// tmm0 = S [16 positions x G heads] fp32, tmm1 = K rows [16 x 32 dims] bf16,
// tmm2 = Q^T [16 dim pairs x G heads] (bf16 pairs).
inline void configure_score_tiles(int64_t G) {
  TileConfig config;
  config.rows[0] = 16;
  config.colsb[0] = static_cast<uint16_t>(G * 4);
  config.rows[1] = 16;
  config.colsb[1] = 64;
  config.rows[2] = 16;
  config.colsb[2] = static_cast<uint16_t>(G * 4);
  load_tile_config(config);
}

// acc (G query heads x D, dims in the order of `pair_dims`) += P . V over a chunk's
// position pairs [pair_begin, pair_end): V rows t and t+1 interleaved, so that one
// VDPBF16PS adds p_t v_t + p_t+1 v_t+1 for 16 dims. `keep` masks out a row of the
// first or last pair that lies outside the visible positions.
template <int D, int GB>
inline void pair_values(const uint32_t* p_pairs, int64_t lane, const uint16_t* v,
                        int64_t row_stride, int64_t pair_begin, int64_t pair_end,
                        __mmask32 keep_first, __mmask32 keep_last, float* acc,
                        PrefetchStream& pf) {
  __m512 a[GB][D / 16];
  for (int gb = 0; gb < GB; ++gb)
    for (int c = 0; c < D / 16; ++c) a[gb][c] = _mm512_loadu_ps(acc + gb * D + 16 * c);
  for (int64_t i = pair_begin; i < pair_end; ++i) {
    pf.step();
    const uint16_t* v0 = v + 2 * i * row_stride;
    const __mmask32 keep = (i == pair_begin ? keep_first : ~__mmask32{0}) &
                           (i == pair_end - 1 ? keep_last : ~__mmask32{0});
    __m512i vi[D / 16];
    for (int c = 0; c < D / 32; ++c) {
      const __m512i r0 = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i r1 = _mm512_loadu_si512(v0 + row_stride + 32 * c);
      vi[2 * c] = _mm512_maskz_mov_epi16(keep, _mm512_unpacklo_epi16(r0, r1));
      vi[2 * c + 1] = _mm512_maskz_mov_epi16(keep, _mm512_unpackhi_epi16(r0, r1));
    }
    for (int gb = 0; gb < GB; ++gb) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(p_pairs[i * 16 + lane + gb]));
      for (int c = 0; c < D / 16; ++c)
        a[gb][c] = _mm512_dpbf16_ps(a[gb][c], (__m512bh)w, (__m512bh)vi[c]);
    }
  }
  for (int gb = 0; gb < GB; ++gb)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + gb * D + 16 * c, a[gb][c]);
}

// Accumulator slot of dim d: unpacklo/hi interleave within 128-bit lanes, so the vector
// pair (2c, 2c + 1) holds dims 32c + 8L + k (lo) and 32c + 8L + 4 + k (hi) in lane 4L + k.
inline int64_t pair_slot(int64_t d) {
  const int64_t c = d / 32, r = d % 32, lane = r / 8, k = r % 4, hi = (r % 8) / 4;
  return 32 * c + 16 * hi + 4 * lane + k;
}

// KV heads kv_head .. kv_head + heads - 1 (heads * G <= 16 query heads) of one request,
// in one pass over its context in chunks of 16 positions aligned in their block. AMX
// computes a chunk's scores for each KV head into one [16 positions x 16 query heads]
// matrix, so the online softmax runs across all query heads at once, one vector per
// position; the probabilities go to bf16 pairs for the P . V product (as transformers'
// eager attention casts them to the value dtype).
template <int D>
void attend_item_amx(const at::BFloat16* q_row, at::BFloat16* out, const at::BFloat16* cache_bf16,
                     const int32_t* blocks, int64_t first, int64_t seq_len, int64_t kv_head,
                     int64_t heads, float scale, const Layout& L, std::vector<float>& work,
                     float out_scale = 1.0f) {
  constexpr int GB = D <= 64 ? 4 : 2;
  const int64_t G = L.group, HG = heads * G, row_stride = L.kv_heads * D;
  const auto* q = reinterpret_cast<const uint16_t*>(q_row) + kv_head * G * D;
  const auto* cache = reinterpret_cast<const uint16_t*>(cache_bf16) + kv_head * D;
  // work: acc [HG x D] | scores [16 x 16] | p pairs [8 x 16] | q^T tiles [heads][D/32][16 x G]
  work.assign(HG * D + 256 + 128 + heads * (D / 32) * 16 * G, 0.0f);
  float* acc = work.data();
  float* scores = acc + HG * D;
  auto* p_pairs = reinterpret_cast<uint32_t*>(scores + 256);
  auto* q_tiles = reinterpret_cast<uint32_t*>(scores + 256 + 128);
  for (int64_t h = 0; h < heads; ++h)  // q^T in pairs: tile (h, c) row r, col g
    for (int64_t c = 0; c < D / 32; ++c)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const uint16_t* pair = q + (h * G + g) * D + 32 * c + 2 * r;
          q_tiles[((h * (D / 32) + c) * 16 + r) * G + g] = pair[0] | (uint32_t(pair[1]) << 16);
        }
  __m512 max = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t start = first - first % 16; start < seq_len; start += 16) {
    const int64_t t0 = std::max<int64_t>(first - start, 0);
    const int64_t t1 = std::min<int64_t>(seq_len - start, 16);
    const int64_t block = blocks[start / L.block_size];
    const uint16_t* k = cache + (block * L.block_size + start % L.block_size) * row_stride;
    PrefetchStream pf;
    const int64_t ahead = start + kAmxPrefetchBlocks * L.block_size;
    if (ahead < seq_len) {
      const int64_t slot = blocks[ahead / L.block_size] * L.block_size + ahead % L.block_size;
      pf.k = reinterpret_cast<const char*>(cache + slot * row_stride);
      pf.v = pf.k + L.cache_half * 2;
      pf.bytes = std::min<int64_t>(16, seq_len - ahead) * row_stride * 2;
      const int64_t steps = heads * (((G + GB - 1) / GB) * ((t1 - t0 + 2) / 2) + 2);
      pf.per_step = (pf.bytes / 64 + steps - 1) / steps;
    }
    for (int64_t h = 0; h < heads; ++h) {
      _tile_zero(0);
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(1, k + h * D + 32 * c, row_stride * 2);
        _tile_loadd(2, q_tiles + (h * (D / 32) + c) * 16 * G, G * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, scores + h * G, 64);
      pf.step();  // the score phase requests lines too, or the fill buffers idle through it
      pf.step();
    }
    __m512 s[16];
    __m512 chunk_max = _mm512_set1_ps(-INFINITY);
    for (int64_t t = t0; t < t1; ++t) {
      s[t] = _mm512_mul_ps(_mm512_loadu_ps(scores + 16 * t), vscale);
      chunk_max = _mm512_max_ps(chunk_max, s[t]);
    }
    const __m512 new_max = _mm512_max_ps(max, chunk_max);
    const __m512 rescale = exp_nonpositive16(_mm512_sub_ps(max, new_max));
    max = new_max;
    __m512 p[17];
    __m512 chunk_sum = _mm512_setzero_ps();
    p[t0 & ~int64_t{1}] = p[t1] = p[t0] = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      p[t] = exp_nonpositive16(_mm512_sub_ps(s[t], max));
      chunk_sum = _mm512_add_ps(chunk_sum, p[t]);
    }
    sum = _mm512_fmadd_ps(sum, rescale, chunk_sum);
    const int64_t pair_begin = t0 / 2, pair_end = (t1 + 1) / 2;
    for (int64_t i = pair_begin; i < pair_end; ++i)
      _mm512_storeu_si512(p_pairs + 16 * i, pair_rows(p[2 * i], p[2 * i + 1]));
    const __mmask32 keep_first = (t0 % 2) ? 0xAAAAAAAAu : 0xFFFFFFFFu;
    const __mmask32 keep_last = (t1 % 2) ? 0x55555555u : 0xFFFFFFFFu;
    if (_mm512_cmp_ps_mask(rescale, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) &
        static_cast<__mmask16>((1u << HG) - 1)) {
      alignas(64) float f[16];
      _mm512_store_ps(f, rescale);
      for (int64_t j = 0; j < HG; ++j)
        for (int64_t c = 0; c < D / 16; ++c) {
          float* a = acc + j * D + 16 * c;
          _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_set1_ps(f[j])));
        }
    }
    const uint16_t* v = k + L.cache_half;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t g = 0; g < G; g += GB) {
        const int64_t j = h * G + g;
        float* a = acc + j * D;
        const uint16_t* vh = v + h * D;
        switch (std::min<int64_t>(GB, G - g)) {
          case 4:
            pair_values<D, 4>(p_pairs, j, vh, row_stride, pair_begin, pair_end, keep_first,
                              keep_last, a, pf);
            break;
          case 3:
            pair_values<D, 3>(p_pairs, j, vh, row_stride, pair_begin, pair_end, keep_first,
                              keep_last, a, pf);
            break;
          case 2:
            pair_values<D, 2>(p_pairs, j, vh, row_stride, pair_begin, pair_end, keep_first,
                              keep_last, a, pf);
            break;
          default:
            pair_values<D, 1>(p_pairs, j, vh, row_stride, pair_begin, pair_end, keep_first,
                              keep_last, a, pf);
        }
      }
  }
  alignas(64) float total[16];
  _mm512_store_ps(total, sum);
  at::BFloat16* o = out + kv_head * G * D;
  for (int64_t j = 0; j < HG; ++j) {
    const float inv = out_scale / total[j];
    for (int64_t d = 0; d < D; ++d)
      o[j * D + d] = static_cast<at::BFloat16>(acc[j * D + pair_slot(d)] * inv);
  }
}

}  // namespace
#endif
