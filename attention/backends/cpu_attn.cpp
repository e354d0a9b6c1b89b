// Paged decode attention on CPU, reading K and V in place from the paged cache, and the
// store of a step's K/V rows into that cache. Prefills have kernels of their own, bound
// here too: cpu_prefill_amx.h (bf16 with AMX) and cpu_prefill_avx2.h (float32 math).
//
// kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]. One work item is a
// (decode request, KV head) pair, or a whole request when there are enough requests to
// keep every thread busy: the G query heads that share a KV head are handled together,
// so each K and V row of the request's context is read once per step. Items are spread
// over the OpenMP threads dynamically, since contexts differ in length. Three paths:
//   - AMX (cpu_attn_amx.h): bf16 on CPUs with AMX-BF16, one pass with an online softmax;
//   - AVX2 (cpu_attn_avx2.h): float32, bf16 and fp16 pages of head sizes that are multiples
//     of 64 elsewhere, one pass with an online softmax, prefetching as it goes (it also
//     beat a kernel of AVX512-BF16 dot products on bf16 pages: 1.6-1.75 against 1.8-2.2
//     ms a layer at 64 decodes on a Zen 4, memory bound either way);
//   - generic (here): every dtype and head size, two passes (scores q.k for every visible
//     position and an exact softmax over them, then the weighted sum of V rows).
// fp8 pages (cpu_attn_fp8.h), read times the layer's k/v scales: with bf16 queries on
// AVX512-BF16 CPUs, the AMX or AVX2 path over a bf16 copy of the item's context; else
// generic, widened in registers.
// Storage stays in the cache's dtype; softmax and accumulation are fp32.
#include "torch_ext.h"

#include "cpu_api.h"
#include "cpu_math.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) { return splitserve::bf16_to_float(x.x); }

using splitserve::exp_nonpositive;

struct Layout {
  int64_t block_size, kv_heads, head_dim, group;
  int64_t q_row_stride, out_row_stride, table_stride;
  int64_t cache_half;  // elements between kv_cache[0] and kv_cache[1]
};

}  // namespace

#include "cpu_attn_fp8.h"

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

// Into L1 (prefetcht0) on Intel CPUs, into L2 (prefetcht1) on others. On AMD a prefetch
// into L1 holds one of the core's few L1 miss buffers until its line arrives, which
// bounded the decode paths at 13-14 GB/s where two threads stream 33 (2 Zen 4 cores, 64
// float32 decodes over 30 layers' pages: 2.65-2.89 ms a layer with prefetcht0, 1.93-2.03
// with prefetcht1); on 2 Emerald Rapids cores the same run takes 1.88 ms with prefetcht0,
// 2.02-2.11 with prefetcht1 (prefetchnta: 4.6). As asm on x86: gcc 12 deletes a loop of
// __builtin_prefetch calls as having no effect.
#if defined(__x86_64__)
const bool kPrefetchIntoL1 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") != 0;
}();
#endif

inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  if (kPrefetchIntoL1)
    asm volatile("prefetcht0 %0" : : "m"(*p));
  else
    asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

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
template <typename T, typename C, int D>
void attend_item(const T* q, T* out, const C* cache, const int32_t* blocks, int64_t first,
                 int64_t seq_len, int64_t kv_head, float scale, float k_mul, float v_mul,
                 const Layout& L, std::vector<float>& work) {
  const int64_t dim = L.head_dim, G = L.group, n = seq_len - first;
  work.resize(G * dim * 2 + G * n);
  float* qf = work.data();
  float* acc = qf + G * dim;
  float* scores = acc + G * dim;
  for (int64_t g = 0; g < G; ++g) {
    const T* qrow = q + (kv_head * G + g) * dim;
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(qrow[d]) * (scale * k_mul);
  }
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
      for (int64_t g = 0; g < G; ++g) axpy<C, D>(acc + g * dim, scores[g * n + pos - first], v, dim);
  }
  for (int64_t g = 0; g < G; ++g) {
    T* orow = out + (kv_head * G + g) * dim;
    for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[g * dim + d] * v_mul);
  }
}

}  // namespace

#include "cpu_attn_avx2.h"
#include "cpu_attn_amx.h"
#include "cpu_prefill_amx.h"
#include "cpu_prefill_avx2.h"

namespace {

constexpr int32_t kOneBlock[1] = {0};  // the block table of a widened context
#if defined(SPLITSERVE_AVX512_BF16)
constexpr bool kHaveBf16Widening = true;  // fp8 pages widen to bf16 (cpu_attn_fp8.h)
#else
constexpr bool kHaveBf16Widening = false;
#endif

// f(T{}) for the dtypes a model computes in (float32, bf16, fp16): each instantiates every
// path, so float64 (which no model runs in) is not built.
template <typename F>
void dispatch_model_dtype(at::ScalarType type, const char* name, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, name, " takes float32, bfloat16 or float16, not ", type);
  }
}

// Whether a bf16 decode with this layout takes the AMX path (items of at most 16 query
// heads, chunks of 16 positions within a block).
bool takes_amx_path(const Layout& L) {
#if defined(SPLITSERVE_AMX)
  return L.group <= 16 && L.block_size % 16 == 0 && amx_usable();
#else
  return false;
#endif
}

constexpr int64_t kWholeRequestsPerThread = 8;  // from here on an item is a whole request

template <typename T, typename C, int D>
void decode_all(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                const at::Tensor& block_table, const at::Tensor& seq_lens,
                const at::Tensor& reqs, const at::Tensor& rows, double scale,
                int64_t window, float k_mul, float v_mul, const Layout& L) {
  // Whole requests per item when there are enough of them to keep every thread busy: a
  // position's rows of all KV heads are adjacent in its page, read by one thread at about
  // one time (the AVX2 path: ~8% faster at 64 decodes than an item per KV head). fp8
  // pages with bf16 queries take the AMX or AVX2 path over a widened copy (cpu_attn_fp8.h).
  constexpr bool kBf16Path = std::is_same_v<T, at::BFloat16> &&
                             (std::is_same_v<C, T> || kIsFp8<C>) && D > 0 && kHaveBf16Widening;
  const bool whole = reqs.size(0) >= kWholeRequestsPerThread * at::get_num_threads();
  const bool amx = kBf16Path && takes_amx_path(L);
  int64_t heads = whole ? L.kv_heads : 1;
  while (amx && (heads * L.group > 16 || L.kv_heads % heads)) --heads;  // AMX: <= 16 q heads
  const int64_t items_per_req = L.kv_heads / heads, num_items = reqs.size(0) * items_per_req;
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const C* cache = kv_cache.data_ptr<C>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* req_ptr = reqs.data_ptr<int64_t>();
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> work;
    std::vector<uint16_t> widened;
#if defined(SPLITSERVE_AMX)
    if (amx) configure_score_tiles(L.group);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t i = item / items_per_req, kv_head = (item % items_per_req) * heads;
      const int64_t req = req_ptr[i], row = row_ptr[i], seq_len = lens[req];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const T* q_row = q_ptr + row * L.q_row_stride;
      T* out_row = out_ptr + row * L.out_row_stride;
      const int32_t* blocks = table + req * L.table_stride;
#if defined(SPLITSERVE_AVX512_BF16)
      if constexpr (kBf16Path) {
        const at::BFloat16* pages = reinterpret_cast<const at::BFloat16*>(cache);
        Layout layout = L;
        int64_t from = first, to = seq_len, head = kv_head;
        float item_scale = static_cast<float>(scale), out_scale = 1.0f;
        if constexpr (kIsFp8<C>) {  // widened values are the fp8 ones, not page units
          widen_context<C, D>(cache, blocks, first, seq_len, kv_head, heads, L, widened, layout);
          pages = reinterpret_cast<const at::BFloat16*>(widened.data());
          blocks = kOneBlock;
          from = 0, to = seq_len - first, head = 0;
          q_row += kv_head * L.group * D;
          out_row += kv_head * L.group * D;
          item_scale *= k_mul / kPageUnit<C>;
          out_scale = v_mul / kPageUnit<C>;
        }
#if defined(SPLITSERVE_AMX)
        if (amx) {
          attend_item_amx<D>(q_row, out_row, pages, blocks, from, to, head, heads, item_scale,
                             layout, work, out_scale);
          continue;
        }
#endif
        attend_item_avx2<at::BFloat16, at::BFloat16, D>(q_row, out_row, pages, blocks, from, to,
                                                        head, heads, item_scale, layout, work,
                                                        out_scale);
        continue;
      }
#endif
#if defined(SPLITSERVE_AVX2)
      if constexpr (kAvx2Path<C, D>) {
        attend_item_avx2<T, C, D>(q_row, out_row, cache, blocks, first, seq_len, kv_head, heads,
                                  static_cast<float>(scale), L, work);
        continue;
      }
#endif
      for (int64_t h = kv_head; h < kv_head + heads; ++h)
        attend_item<T, C, D>(q_row, out_row, cache, blocks, first, seq_len, h,
                             static_cast<float>(scale), k_mul, v_mul, L, work);
    }
#if defined(SPLITSERVE_AMX)
    if (amx) _tile_release();
#endif
  }
}

}  // namespace

namespace splitserve::attn {

// out, q: [T, num_heads, head_dim] (rows may be strided); kv_cache: [2, num_blocks,
// block_size, num_kv_heads, head_dim]; block_table [R, max_blocks] int32; seq_lens [R]
// int32; reqs, rows [N] int64: decode i is request reqs[i], query row rows[i]. window <= 0
// means none; otherwise the last `window` positions are visible. An fp8 cache (q of any
// float dtype) is read times k_scale and v_scale.
void paged_decode(at::Tensor out, at::Tensor q, at::Tensor kv_cache,
                  at::Tensor block_table, at::Tensor seq_lens, at::Tensor reqs,
                  at::Tensor rows, double scale, int64_t window, double k_scale,
                  double v_scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode runs on CPU");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must be dense");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out rows must be dense");
  TORCH_CHECK(kv_cache.is_contiguous() && block_table.is_contiguous(), "cache, table dense");
  const auto cache_type = kv_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK((fp8 || q.scalar_type() == cache_type) && out.scalar_type() == q.scalar_type(),
              "q, out and kv_cache must share a dtype (or kv_cache be fp8)");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens are int32");
  TORCH_CHECK(reqs.scalar_type() == at::kLong && rows.scalar_type() == at::kLong, "int64 ids");
  const int64_t kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  TORCH_CHECK(q.size(2) == dim && q.size(1) % kv_heads == 0, "head shapes do not match");
  auto seq = seq_lens.contiguous();
  auto req = reqs.contiguous();
  auto row = rows.contiguous();
  const Layout L{kv_cache.size(2), kv_heads,  dim,
                 q.size(1) / kv_heads, q.stride(0), out.stride(0),
                 block_table.stride(0), kv_cache.stride(0)};
  auto run = [&](auto q_type, auto cache_type_tag) {
    using T = decltype(q_type);
    using C = decltype(cache_type_tag);
    const float k_mul = kIsFp8<C> ? float(k_scale) * kPageUnit<C> : 1.0f;
    const float v_mul = kIsFp8<C> ? float(v_scale) * kPageUnit<C> : 1.0f;
    switch (dim) {
      case 64:
        return decode_all<T, C, 64>(out, q, kv_cache, block_table, seq, req, row, scale, window,
                                    k_mul, v_mul, L);
      case 128:
        return decode_all<T, C, 128>(out, q, kv_cache, block_table, seq, req, row, scale,
                                     window, k_mul, v_mul, L);
      default:
        return decode_all<T, C, 0>(out, q, kv_cache, block_table, seq, req, row, scale, window,
                                   k_mul, v_mul, L);
    }
  };
  dispatch_model_dtype(q.scalar_type(), "paged_decode", [&](auto q_type) {
    if (cache_type == at::kFloat8_e4m3fn) return run(q_type, E4M3{});
    if (cache_type == at::kFloat8_e5m2) return run(q_type, E5M2{});
    return run(q_type, q_type);
  });
}

// k, v: [T, num_kv_heads, head_dim] (rows may be strided, as views of one projection);
// kv_cache as above; slot_mapping [N <= T] int64 flat slot ids, -1 = skip. Token t's K and
// V rows are copied to kv_cache[0] and kv_cache[1] at slot_mapping[t]; an fp8 cache gets
// them divided by k_scale and v_scale (cpu_attn_fp8.h). Returns false, writing nothing,
// where the rows are not dense (the caller stores them another way).
bool store_kv(at::Tensor k, at::Tensor v, at::Tensor kv_cache,
              at::Tensor slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && kv_cache.device().is_cpu(),
              "store_kv runs on CPU");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be dense");
  const auto cache_type = kv_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK((fp8 || k.scalar_type() == cache_type) && v.scalar_type() == k.scalar_type(),
              "k, v and kv_cache must share a dtype (or kv_cache be fp8)");
  TORCH_CHECK(k.size(1) == kv_cache.size(3) && k.size(2) == kv_cache.size(4) &&
                  v.sizes() == k.sizes(),
              "k/v heads do not match the cache");
  for (const auto& x : {k, v})
    if (x.stride(2) != 1 || x.stride(1) != x.size(2)) return false;
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping is int64 [N]");
  auto slots_t = slot_mapping.contiguous();
  const int64_t n = slots_t.size(0), num_slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(n <= k.size(0), "more slots than tokens");
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache");
  if (fp8) {
    dispatch_model_dtype(k.scalar_type(), "store_kv", [&](auto k_type) {
      using T = decltype(k_type);
      if (cache_type == at::kFloat8_e4m3fn)
        store_fp8<T, E4M3>(k, v, kv_cache, slots, n, k_scale, v_scale);
      else
        store_fp8<T, E5M2>(k, v, kv_cache, slots, n, k_scale, v_scale);
    });
    return true;
  }
  const int64_t elem = kv_cache.element_size(), row_bytes = k.size(1) * k.size(2) * elem;
  char* key_cache = static_cast<char*>(kv_cache.data_ptr());
  char* value_cache = key_cache + kv_cache.stride(0) * elem;
  const char* key = static_cast<const char*>(k.data_ptr());
  const char* value = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * elem, v_stride = v.stride(0) * elem;
  // Items [0, n) are the K rows, [n, 2n) the V rows, so a decode step's rows (from 17 on)
  // go to two threads by half: the first write to a page of the cache faults it in, and a
  // huge page's zeroing (~5 ms on a VM) of K and of V then runs on both cores, not on one
  // while the other waits.
  at::parallel_for(0, 2 * n, 32, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bool is_value = i >= n;
      const int64_t t = is_value ? i - n : i;
      if (slots[t] < 0) continue;
      char* dst = (is_value ? value_cache : key_cache) + slots[t] * row_bytes;
      std::memcpy(dst, is_value ? value + t * v_stride : key + t * k_stride, row_bytes);
    }
  });
  return true;
}

// Causal prefill attention over the paged cache. q, out: [T, num_heads, head_dim] with
// dense rows; kv_cache as above, holding every context position already (fp8 read times
// k_scale and v_scale); block_table [R, max_blocks] int32 (rows may be strided); seq_lens
// [R] int32; query_start_loc [R + 1] int32; reqs [P] int64: the prefills, whose query rows
// are query_start_loc[r] .. query_start_loc[r + 1] - 1, the last positions of their
// context; window > 0: the layer's sliding window. The AMX kernel (cpu_prefill_amx.h) takes
// bf16 queries without a window over blocks of 16k positions where the CPU has AMX, the
// AVX2 one (cpu_prefill_avx2.h) any other prefill of a build from AVX2 up; both take head
// sizes 64 and 128 only. Returns false, computing nothing, where neither takes it (the
// caller runs its own). Inputs that do not fit together raise.
bool paged_prefill(at::Tensor out, at::Tensor q, at::Tensor kv_cache,
                   at::Tensor block_table, at::Tensor seq_lens,
                   at::Tensor query_start_loc, at::Tensor reqs, double scale,
                   int64_t window, double k_scale, double v_scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_prefill runs on CPU");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  const auto type = q.scalar_type(), cache_type = kv_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK((fp8 || type == cache_type) && out.scalar_type() == type,
              "q, out and kv_cache must share a dtype (or kv_cache be fp8)");
  const int64_t kv_heads = kv_cache.size(3), dim = kv_cache.size(4), heads = q.size(1);
  TORCH_CHECK(q.size(2) == dim && heads % kv_heads == 0, "head shapes do not match");
  const bool model_dtype = type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
  if (!model_dtype || (dim != 64 && dim != 128)) return false;
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must be dense");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out rows must be dense");
  TORCH_CHECK(kv_cache.is_contiguous() && block_table.stride(1) == 1, "cache, table rows dense");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && reqs.scalar_type() == at::kLong,
              "int32 table, lengths and offsets; int64 request ids");
  auto lens_t = seq_lens.contiguous(), starts_t = query_start_loc.contiguous();
  auto reqs_t = reqs.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* starts = starts_t.data_ptr<int32_t>();
  const int64_t* req_ids = reqs_t.data_ptr<int64_t>();
  const int64_t num_prefills = reqs_t.size(0);
  for (int64_t p = 0; p < num_prefills; ++p)
    TORCH_CHECK(starts[req_ids[p] + 1] - starts[req_ids[p]] <= lens[req_ids[p]],
                "more queries than context");
#if defined(SPLITSERVE_AMX)
  if (amx_usable() && type == at::kBFloat16 && window <= 0 && kv_cache.size(2) % 16 == 0) {
    if (cache_type == at::kFloat8_e4m3fn)
      prefill_all<E4M3>(out, q, kv_cache, block_table, lens, starts, req_ids, num_prefills,
                        scale, k_scale, v_scale);
    else if (cache_type == at::kFloat8_e5m2)
      prefill_all<E5M2>(out, q, kv_cache, block_table, lens, starts, req_ids, num_prefills,
                        scale, k_scale, v_scale);
    else
      prefill_all<uint16_t>(out, q, kv_cache, block_table, lens, starts, req_ids,
                            num_prefills, scale, k_scale, v_scale);
    return true;
  }
#endif
#if defined(SPLITSERVE_AVX2)
  const Layout L{kv_cache.size(2),     kv_heads,      dim,
                 heads / kv_heads,     q.stride(0),   out.stride(0),
                 block_table.stride(0), kv_cache.stride(0)};
  const int32_t* table = block_table.data_ptr<int32_t>();
  auto run = [&](auto q_type, auto cache_tag) {
    using T = decltype(q_type);
    using C = decltype(cache_tag);
    const float k_mul = kIsFp8<C> ? float(k_scale) * kPageUnit<C> : 1.0f;
    const float v_mul = kIsFp8<C> ? float(v_scale) * kPageUnit<C> : 1.0f;
    if (dim == 64)
      prefill_all_avx2<T, C, 64>(out, q, kv_cache, table, lens, starts, req_ids, num_prefills,
                                 scale, window, k_mul, v_mul, L);
    else
      prefill_all_avx2<T, C, 128>(out, q, kv_cache, table, lens, starts, req_ids, num_prefills,
                                  scale, window, k_mul, v_mul, L);
  };
  dispatch_model_dtype(type, "paged_prefill", [&](auto q_type) {
    if (cache_type == at::kFloat8_e4m3fn) return run(q_type, E4M3{});
    if (cache_type == at::kFloat8_e5m2) return run(q_type, E5M2{});
    return run(q_type, q_type);
  });
  return true;
#else
  return false;
#endif
}

bool has_amx_path() {
#if defined(SPLITSERVE_AMX)
  return amx_usable();
#else
  return false;
#endif
}

}  // namespace splitserve::attn
