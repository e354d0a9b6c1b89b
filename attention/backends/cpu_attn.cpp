// Paged decode attention on CPU, reading K and V in place from the paged cache, and the
// store of a step's K/V rows into that cache (prefill: cpu_prefill.cpp).
//
// kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]. One work item is a
// (decode request, KV head) pair, or a whole request when there are enough requests to
// keep every thread busy: the G query heads that share a KV head are handled together,
// so each K and V row of the request's context is read once per step. Items are spread
// over the OpenMP threads dynamically, since contexts differ in length. Three paths:
//   - AMX (cpu_attn_amx.h): bf16 on CPUs with AMX-BF16, one pass with an online softmax;
//   - AVX2 and Arm (cpu_attn_vec8.h): float32, bf16 and fp16 pages of head sizes that are
//     multiples of 64 elsewhere, one pass with an online softmax, prefetching as it goes (it also
//     beat a kernel of AVX512-BF16 dot products on bf16 pages: 1.6-1.75 against 1.8-2.2
//     ms a layer at 64 decodes on a Zen 4, memory bound either way);
//   - generic (cpu_attn_generic.h): every dtype and head size, two passes (scores q.k for
//     every visible position and an exact softmax over them, then the weighted sum of V rows).
// fp8 pages (cpu_attn_fp8.h), read times the layer's k/v scales: with bf16 queries on
// AVX512-BF16 CPUs, the AMX or AVX2 path over a bf16 copy of the item's context; else
// generic, widened in registers.
#include "torch_ext.h"

#include "cpu_attn_common.h"

#include "cpu_attn_generic.h"
#include "cpu_attn_vec8.h"
#include "cpu_attn_amx.h"

namespace {

#if defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)
// attend_vec8 on one item: its query rows read times scale, its output rows written times
// out_scale.
template <typename C, int D>
void attend_item_vec8(ModelRow q, ModelRow out, const C* cache, const int32_t* blocks,
                      int64_t first, int64_t seq_len, int64_t kv_head, int64_t heads, float scale,
                      const Layout& L, std::vector<float>& work, float out_scale = 1.0f) {
  const int64_t G = L.group, rows = heads * G;
  work.resize(rows * (2 * D + 1) + vec8_work_floats(rows));
  float* qf = work.data();     // [rows][D]
  float* acc = qf + rows * D;  // [rows][D]
  float* sum = acc + rows * D;  // [rows]
  (q + kv_head * G * D).load(rows * D, scale, qf);
  attend_vec8<C, D>(qf, acc, sum, cache, blocks, first, seq_len, kv_head, heads, L, sum + rows);
  for (int64_t r = 0; r < rows; ++r)
    (out + (kv_head * G + r) * D).store(acc + r * D, D, out_scale / sum[r]);
}
#endif

constexpr int32_t kOneBlock[1] = {0};  // the block table of a widened context
#if defined(SPLITSERVE_AVX512_BF16)
constexpr bool kHaveBf16Widening = true;  // fp8 pages widen to bf16 (cpu_attn_fp8.h)
#else
constexpr bool kHaveBf16Widening = false;
#endif

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

template <typename C, int D>
void decode_all(ModelRow out, ModelRow q, const at::Tensor& kv_cache,
                const at::Tensor& block_table, const at::Tensor& seq_lens,
                const at::Tensor& reqs, const at::Tensor& rows, double scale,
                int64_t window, float k_mul, float v_mul, const Layout& L) {
  // Whole requests per item when there are enough of them to keep every thread busy: a
  // position's rows of all KV heads are adjacent in its page, read by one thread at about
  // one time (the AVX2 path: ~8% faster at 64 decodes than an item per KV head). fp8
  // pages with bf16 queries take the AMX or AVX2 path over a widened copy (cpu_attn_fp8.h).
  constexpr bool kBf16Pages =
      (std::is_same_v<C, at::BFloat16> || kIsFp8<C>) && D > 0 && kHaveBf16Widening;
  const bool bf16 = kBf16Pages && q.type == at::kBFloat16;
  const bool whole = reqs.size(0) >= kWholeRequestsPerThread * at::get_num_threads();
  const bool amx = bf16 && takes_amx_path(L);
  int64_t heads = whole ? L.kv_heads : 1;
  while (amx && (heads * L.group > 16 || L.kv_heads % heads)) --heads;  // AMX: <= 16 q heads
  const int64_t items_per_req = L.kv_heads / heads, num_items = reqs.size(0) * items_per_req;
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
      ModelRow q_row = q + row * L.q_row_stride, out_row = out + row * L.out_row_stride;
      const int32_t* blocks = table + req * L.table_stride;
#if defined(SPLITSERVE_AVX512_BF16)
      if constexpr (kBf16Pages) {
        if (bf16) {
          const at::BFloat16* pages = reinterpret_cast<const at::BFloat16*>(cache);
          Layout layout = L;
          int64_t from = first, to = seq_len, head = kv_head;
          float item_scale = static_cast<float>(scale), out_scale = 1.0f;
          if constexpr (kIsFp8<C>) {  // widened values are the fp8 ones, not page units
            widen_context<C, D>(cache, blocks, first, seq_len, kv_head, heads, L, widened, layout);
            pages = reinterpret_cast<const at::BFloat16*>(widened.data());
            blocks = kOneBlock;
            from = 0, to = seq_len - first, head = 0;
            q_row = q_row + kv_head * L.group * D;
            out_row = out_row + kv_head * L.group * D;
            item_scale *= k_mul / kPageUnit<C>;
            out_scale = v_mul / kPageUnit<C>;
          }
#if defined(SPLITSERVE_AMX)
          if (amx) {
            attend_item_amx<D>(reinterpret_cast<const at::BFloat16*>(q_row.data),
                               reinterpret_cast<at::BFloat16*>(out_row.data), pages, blocks, from,
                               to, head, heads, item_scale, layout, work, out_scale);
            continue;
          }
#endif
          attend_item_vec8<at::BFloat16, D>(q_row, out_row, pages, blocks, from, to, head, heads,
                                            item_scale, layout, work, out_scale);
          continue;
        }
      }
#endif
#if defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)
      if constexpr (kVec8Path<C, D>) {
        attend_item_vec8<C, D>(q_row, out_row, cache, blocks, first, seq_len, kv_head, heads,
                               static_cast<float>(scale), L, work);
        continue;
      }
#endif
      for (int64_t h = kv_head; h < kv_head + heads; ++h)
        attend_item<C, D>(q_row, out_row, cache, blocks, first, seq_len, h,
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
  TORCH_CHECK(is_model_dtype(q.scalar_type()),
              "paged_decode takes float32, bfloat16 or float16, not ", q.scalar_type());
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
  const ModelRow out_rows = ModelRow::of(out), q_rows = ModelRow::of(q);
  auto run = [&](auto cache_tag) {
    using C = decltype(cache_tag);
    const float k_mul = page_multiplier<C>(k_scale), v_mul = page_multiplier<C>(v_scale);
    switch (dim) {
      case 64:
        return decode_all<C, 64>(out_rows, q_rows, kv_cache, block_table, seq, req, row, scale,
                                 window, k_mul, v_mul, L);
      case 128:
        return decode_all<C, 128>(out_rows, q_rows, kv_cache, block_table, seq, req, row, scale,
                                  window, k_mul, v_mul, L);
      default:
        return decode_all<C, 0>(out_rows, q_rows, kv_cache, block_table, seq, req, row, scale,
                                window, k_mul, v_mul, L);
    }
  };
  dispatch_page_dtype(cache_type, "paged_decode", run);
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

bool has_amx_path() {
#if defined(SPLITSERVE_AMX)
  return amx_usable();
#else
  return false;
#endif
}

}  // namespace splitserve::attn
