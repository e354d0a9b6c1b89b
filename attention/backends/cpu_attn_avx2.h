// The AVX2 decode path of cpu_attn.cpp (included there, inside its namespace), for float32,
// bf16 and fp16 pages of head sizes that are multiples of 64 (fp8 pages keep the generic
// path): the generic path's two passes, vectorised by hand. Scores 8 positions at a time,
// their 8 partial-sum vectors reduced together (no lane sum per position); the weighted
// sum of V rows of one query head, 64 features at a time, in 8 accumulators that stay in
// registers across the context. Pages are widened to float32 as they are loaded.
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

// One (request, KV head) item, as attend_item. The pages' rows of `prefetch_heads` KV
// heads from kv_head on are prefetched ahead of the scores (0: none, where an earlier
// head's pass of the same request brought them).
template <typename T, typename C, int D>
void attend_item_avx2(const T* q, T* out, const C* cache, const int32_t* blocks, int64_t first,
                      int64_t seq_len, int64_t kv_head, float scale, const Layout& L,
                      std::vector<float>& work, int64_t prefetch_heads) {
  const int64_t G = L.group, n = seq_len - first, row_stride = L.kv_heads * D;
  work.resize(G * D + G * (n + 8) + G);
  float* qf = work.data();
  float* scores = qf + G * D;
  float* inv = scores + G * (n + 8);  // 1 / each query head's softmax sum
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q[(kv_head * G + g) * D + d]) * scale;
  auto row = [&](int64_t pos) {  // offset of (pos, kv_head) in kv_cache[0]
    return (blocks[pos / L.block_size] * L.block_size + pos % L.block_size) * row_stride +
           kv_head * D;
  };
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t end = std::min(seq_len, (pos / L.block_size + 1) * L.block_size);
    if (prefetch_heads)
      prefetch_block(cache, blocks, pos / L.block_size + kPrefetchBlocks, seq_len, kv_head, D, L,
                     prefetch_heads);
    for (const C* k = cache + row(pos); pos < end;) {
      const int count = static_cast<int>(std::min<int64_t>(8, end - pos));
      for (int64_t g = 0; g < G; ++g) {
        __m256 acc[8];
        for (int t = 0; t < 8; ++t) {
          acc[t] = _mm256_setzero_ps();
          if (t >= count) continue;
          for (int c = 0; c < D / 8; ++c)
            acc[t] = _mm256_fmadd_ps(load8(k + t * row_stride + 8 * c),
                                     _mm256_loadu_ps(qf + g * D + 8 * c), acc[t]);
        }
        // Scores are padded by 8: a short group writes past its last position, into the
        // next group's (or the padding), which the next store or nothing reads.
        _mm256_storeu_ps(scores + g * (n + 8) + pos - first, sum_lanes_8(acc));
      }
      pos += count;
      k += count * row_stride;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * (n + 8);
    inv[g] = 1.0f / splitserve::exp_sum8(row, n, splitserve::max8(row, n));
  }
  const C* values = cache + L.cache_half;
  for (int64_t g = 0; g < G; ++g) {
    const float* p = scores + g * (n + 8);
    T* orow = out + (kv_head * G + g) * D;
    for (int half = 0; half < D / 64; ++half) {
      __m256 acc[8];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t pos = first; pos < seq_len;) {
        const int64_t end = std::min(seq_len, (pos / L.block_size + 1) * L.block_size);
        for (const C* v = values + row(pos) + 64 * half; pos < end; ++pos, v += row_stride) {
          const __m256 w = _mm256_broadcast_ss(p + pos - first);
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), acc[c]);
        }
      }
      alignas(32) float sums[64];
      for (int c = 0; c < 8; ++c) _mm256_store_ps(sums + 8 * c, acc[c]);
      for (int d = 0; d < 64; ++d) orow[64 * half + d] = static_cast<T>(sums[d] * inv[g]);
    }
  }
}

#endif

}  // namespace
