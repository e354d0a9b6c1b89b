// The AVX512-BF16 decode path of cpu_attn.cpp (included there, inside its namespace):
// two passes over a context, scores for every visible position and then the weighted sum
// of V rows, used where the CPU has AVX512-BF16 but no AMX.
#pragma once

namespace {

#if defined(SPLITSERVE_AVX512_BF16)
constexpr bool kHaveBf16Path = true;
#else
constexpr bool kHaveBf16Path = false;
#endif

#if defined(SPLITSERVE_AVX512_BF16)
// bf16 with AVX512-BF16: q.k by VDPBF16PS straight from the bf16 rows (products of two
// bf16 are exact in fp32), 16 positions at a time, their 16 partial-sum vectors reduced
// together by a transpose-add tree; V rows widened to fp32 once per position and
// accumulated for up to 64 / (head_dim / 16) query heads in registers.

// Lane t of the result is the sum of the 16 lanes of v[t].
inline __m512 sum_lanes_16(__m512* v) {
  __m512 s[8], w[4];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                            _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88),
                            _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// scores[g * n + offset + t] = scale * q_g . k_t for the `count` (<= 16) rows from k.
template <int D>
inline void bf16_scores(const uint16_t* q, const uint16_t* k, int64_t row_stride, int count,
                        int64_t G, float scale, float* scores, int64_t n, int64_t offset) {
  for (int64_t g = 0; g < G; ++g) {
    __m512i qv[D / 32];
    for (int c = 0; c < D / 32; ++c) qv[c] = _mm512_loadu_si512(q + g * D + 32 * c);
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) {
      acc[t] = _mm512_setzero_ps();
      if (t >= count) continue;
      for (int c = 0; c < D / 32; ++c)
        acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)qv[c],
                                  (__m512bh)_mm512_loadu_si512(k + t * row_stride + 32 * c));
    }
    __m512 sums = _mm512_mul_ps(sum_lanes_16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + g * n + offset, (__mmask16)((1u << count) - 1), sums);
  }
}

// acc[gb * D + d] = sum over positions of p[gb * n + i] * v_i[d], for GB query heads.
template <int D, int GB>
inline void bf16_values(const float* p, int64_t n, const uint16_t* values,
                        const int32_t* blocks, int64_t first, int64_t seq_len, int64_t kv_head,
                        const Layout& L, float* acc) {
  __m512 a[GB][D / 16];
  for (int gb = 0; gb < GB; ++gb)
    for (int c = 0; c < D / 16; ++c) a[gb][c] = _mm512_setzero_ps();
  const int64_t row_stride = L.kv_heads * D;
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t end = std::min(seq_len, (pos / L.block_size + 1) * L.block_size);
    const int64_t block = blocks[pos / L.block_size];
    const uint16_t* v =
        values + (block * L.block_size + pos % L.block_size) * row_stride + kv_head * D;
    for (; pos < end; ++pos, v += row_stride) {
      __m512 vf[D / 16];
      for (int c = 0; c < D / 16; ++c) vf[c] = splitserve::bf16x16_to_float(v + 16 * c);
      for (int gb = 0; gb < GB; ++gb) {
        const __m512 w = _mm512_set1_ps(p[gb * n + pos - first]);
        for (int c = 0; c < D / 16; ++c) a[gb][c] = _mm512_fmadd_ps(w, vf[c], a[gb][c]);
      }
    }
  }
  for (int gb = 0; gb < GB; ++gb)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + gb * D + 16 * c, a[gb][c]);
}

// KV heads kv_head .. kv_head + heads - 1 of one request. With all of a request's heads
// in one item, each block's K and V rows are read as one contiguous run.
template <int D>
void attend_item_bf16(const at::BFloat16* q_row, at::BFloat16* out, const at::BFloat16* cache_bf16,
                      const int32_t* blocks, int64_t first, int64_t seq_len, int64_t kv_head,
                      int64_t heads, float scale, const Layout& L, std::vector<float>& work,
                      float out_scale = 1.0f) {
  constexpr int GB = D <= 64 ? 4 : (D <= 128 ? 2 : 1);
  const int64_t G = L.group, n = seq_len - first, row_stride = L.kv_heads * D;
  const auto* q = reinterpret_cast<const uint16_t*>(q_row) + kv_head * G * D;
  const auto* cache = reinterpret_cast<const uint16_t*>(cache_bf16) + kv_head * D;
  work.resize(heads * G * (n + D));
  float* scores = work.data();
  float* acc = scores + heads * G * n;
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t end =
        std::min({seq_len, (pos / L.block_size + 1) * L.block_size, pos + int64_t{16}});
    const int64_t block = blocks[pos / L.block_size];
    if (pos % L.block_size == 0 || pos == first)
      prefetch_block(cache, blocks, pos / L.block_size + kPrefetchBlocks, seq_len, 0, D, L, heads);
    const uint16_t* k = cache + (block * L.block_size + pos % L.block_size) * row_stride;
    for (int64_t h = 0; h < heads; ++h)
      bf16_scores<D>(q + h * G * D, k + h * D, row_stride, static_cast<int>(end - pos), G, scale,
                     scores + h * G * n, n, pos - first);
    pos = end;
  }
  softmax_rows(scores, heads * G, n);
  const uint16_t* values = cache + L.cache_half;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < G; g += GB) {
      const float* p = scores + (h * G + g) * n;
      float* a = acc + (h * G + g) * D;
      switch (std::min<int64_t>(GB, G - g)) {
        case 4:
          bf16_values<D, 4>(p, n, values, blocks, first, seq_len, h, L, a);
          break;
        case 3:
          bf16_values<D, 3>(p, n, values, blocks, first, seq_len, h, L, a);
          break;
        case 2:
          bf16_values<D, 2>(p, n, values, blocks, first, seq_len, h, L, a);
          break;
        default:
          bf16_values<D, 1>(p, n, values, blocks, first, seq_len, h, L, a);
      }
    }
  at::BFloat16* o = out + kv_head * G * D;
  for (int64_t i = 0; i < heads * G * D; ++i) o[i] = static_cast<at::BFloat16>(acc[i] * out_scale);
}
#endif

}  // namespace
