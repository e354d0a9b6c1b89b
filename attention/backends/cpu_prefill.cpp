// Causal prefill attention over the paged cache, every context position read in place from
// its page (this step's K/V were stored first), so fresh prompts, cached prefixes and chunked
// prefills are one case: cpu_prefill_amx.h (bf16 with AMX) and cpu_prefill_widened.h
// (float32 math, x86 builds from AVX2 up and Arm ones). Other builds take none (the caller
// runs its own).
#include "torch_ext.h"

#include "cpu_attn_common.h"

#include "cpu_prefill_amx.h"
#include "cpu_prefill_widened.h"

namespace splitserve::attn {

// Causal prefill attention over the paged cache. q, out: [T, num_heads, head_dim] with
// dense rows; kv_cache as above, holding every context position already (fp8 read times
// k_scale and v_scale); block_table [R, max_blocks] int32 (rows may be strided); seq_lens
// [R] int32; query_start_loc [R + 1] int32; reqs [P] int64: the prefills, whose query rows
// are query_start_loc[r] .. query_start_loc[r + 1] - 1, the last positions of their
// context; window > 0: the layer's sliding window. The AMX kernel (cpu_prefill_amx.h) takes
// bf16 queries without a window over blocks of 16k positions where the CPU has AMX, the
// float32 one (cpu_prefill_widened.h) any other prefill of a build from AVX2 up or for Arm;
// both take head sizes 64 and 128 only. Returns false, computing nothing, where neither
// takes it (the caller runs its own). Inputs that do not fit together raise.
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
  if (!is_model_dtype(type) || (dim != 64 && dim != 128)) return false;
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
#if defined(SPLITSERVE_AVX2) || defined(SPLITSERVE_NEON)
  const Layout L{kv_cache.size(2),     kv_heads,      dim,
                 heads / kv_heads,     q.stride(0),   out.stride(0),
                 block_table.stride(0), kv_cache.stride(0)};
  const int32_t* table = block_table.data_ptr<int32_t>();
  const ModelRow out_rows = ModelRow::of(out), q_rows = ModelRow::of(q);
  auto run = [&](auto cache_tag) {
    using C = decltype(cache_tag);
    const float k_mul = page_multiplier<C>(k_scale), v_mul = page_multiplier<C>(v_scale);
    if (dim == 64)
      prefill_all_vec8<C, 64>(out_rows, q_rows, kv_cache, table, lens, starts, req_ids,
                              num_prefills, scale, window, k_mul, v_mul, L);
    else
      prefill_all_vec8<C, 128>(out_rows, q_rows, kv_cache, table, lens, starts, req_ids,
                               num_prefills, scale, window, k_mul, v_mul, L);
  };
  dispatch_page_dtype(cache_type, "paged_prefill", run);
  return true;
#else
  return false;
#endif
}

}  // namespace splitserve::attn
