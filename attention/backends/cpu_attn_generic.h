// The generic decode path of cpu_attn.cpp (included there, inside its namespace): every
// dtype and head size, two passes per (request, KV head) item: the scores q.k of every
// visible position and an exact softmax over them, then the weighted sum of V rows.
#pragma once

namespace {

// Each of the `rows` rows of n scores becomes its softmax, in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * n;
    float max = s[0];
    for (int64_t i = 1; i < n; ++i) max = std::max(max, s[i]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = exp_nonpositive(s[i] - max);
      sum += s[i];
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
}

// Pages are scattered, so the hardware prefetchers cannot see a context coming: while a
// block is scored, the K and V rows of the block kPrefetchBlocks ahead are requested (V
// is read again after the softmax; a whole context of one KV head fits in L2).
constexpr int64_t kPrefetchBlocks = 4;

template <typename T>
inline void prefetch_block(const T* cache, const int32_t* blocks, int64_t block_index,
                           int64_t seq_len, int64_t kv_head, int64_t dim, const Layout& L,
                           int64_t heads = 1) {
  const int64_t start = block_index * L.block_size;
  if (start >= seq_len) return;
  const int64_t rows = std::min(L.block_size, seq_len - start);
  const int64_t row_stride = L.kv_heads * dim, row_bytes = heads * dim * int64_t(sizeof(T));
  const T* k = cache + blocks[block_index] * L.block_size * row_stride + kv_head * dim;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) {
      const char* line = reinterpret_cast<const char*>(k + r * row_stride) + b;
      prefetch_line(line);
      prefetch_line(line + L.cache_half * int64_t(sizeof(T)));
    }
}

template <typename C, int D>
inline float dot(const float* q, const C* k, int64_t dim) {
  if constexpr (kIsFp8<C> && D > 0) return dot_fp8<C, D>(q, k);
  const int64_t n = D > 0 ? D : dim;
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += q[d] * page_value(k[d]);
  return acc;
}

template <typename C, int D>
inline void axpy(float* acc, float p, const C* v, int64_t dim) {
  if constexpr (kIsFp8<C> && D > 0) return axpy_fp8<C, D>(acc, p, v);
  const int64_t n = D > 0 ? D : dim;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * page_value(v[d]);
}


// One (request, KV head) item: out rows of the G query heads of kv_head. Cache values are
// read in page units (cpu_attn_fp8.h): k_mul and v_mul turn them into K and V.
template <typename C, int D>
void attend_item(ModelRow q, ModelRow out, const C* cache, const int32_t* blocks, int64_t first,
                 int64_t seq_len, int64_t kv_head, float scale, float k_mul, float v_mul,
                 const Layout& L, std::vector<float>& work) {
  const int64_t dim = L.head_dim, G = L.group, n = seq_len - first;
  work.resize(G * dim * 2 + G * n);
  float* qf = work.data();
  float* acc = qf + G * dim;
  float* scores = acc + G * dim;
  (q + kv_head * G * dim).load(G * dim, scale * k_mul, qf);
  const int64_t row_stride = L.kv_heads * dim;
  auto row = [&](int64_t pos) {  // offset of (pos, kv_head) in kv_cache[0]
    const int64_t block = blocks[pos / L.block_size];
    return (block * L.block_size + pos % L.block_size) * row_stride + kv_head * dim;
  };
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t end = std::min(seq_len, (pos / L.block_size + 1) * L.block_size);
    prefetch_block(cache, blocks, pos / L.block_size + kPrefetchBlocks, seq_len, kv_head, dim, L);
    const C* k = cache + row(pos);
    for (; pos < end; ++pos, k += row_stride)
      for (int64_t g = 0; g < G; ++g) scores[g * n + pos - first] = dot<C, D>(qf + g * dim, k, dim);
  }
  softmax_rows(scores, G, n);
  std::fill(acc, acc + G * dim, 0.0f);
  const C* values = cache + L.cache_half;
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t end = std::min(seq_len, (pos / L.block_size + 1) * L.block_size);
    const C* v = values + row(pos);
    for (; pos < end; ++pos, v += row_stride)
      for (int64_t g = 0; g < G; ++g)
        axpy<C, D>(acc + g * dim, scores[g * n + pos - first], v, dim);
  }
  (out + kv_head * G * dim).store(acc, G * dim, v_mul);
}

}  // namespace
