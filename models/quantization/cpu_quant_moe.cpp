// The fused experts of a mixture-of-experts layer whose expert weights are block-quantized
// or fp8 (models/quantization/quant_moe.py): the sum models/layers/moe_experts.py defines,
//
//   out[t] = sum_j weight[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),
//
// each expert's projections computed by the kernels the quantized-linear modules lend
// (kernels/cpu_api.h): block-quantized (int8 activations, or float32 products when exact;
// on rows or on strips) or fp8. In three steps:
//   1. route: a counting sort of the (token, slot) pairs by expert (kernels/moe_routing.h);
//   2. experts: each active expert gathers its pairs' rows of x, runs its gate/up parts,
//      h = silu(gate) * up in float32 rounded to x's dtype, its down projection, and writes
//      weight * y into its pairs' rows of a float32 buffer. Many experts: one expert per
//      thread at a time (the kernels then run serially inside); fewer experts than threads:
//      one after another, each kernel using every thread;
//   3. sum: each token adds its pairs' rows in expert order (as the torch path's
//      index_add_), rounded once to x's dtype.
// A kernel that declines (a dtype it does not take) makes the call return None, and the
// caller runs the torch path.

#include "torch_ext.h"
#include "cpu_math.h"
#include "cpu_quant_moe.h"
#include "moe_routing.h"

#include <atomic>
#include <optional>
#include <vector>

namespace {

using splitserve::quant_moe::QuantExperts;

// h [rows, I] = T(silu(gate) * up), from gate/up outputs in `parts` (one [rows, 2I] part,
// or [rows, I] each).
template <typename T>
void silu_mul(const std::vector<at::Tensor>& parts, int64_t inter, T* h) {
  const int64_t rows = parts[0].size(0);
  const T* g = parts[0].data_ptr<T>();
  const T* u = parts.size() == 1 ? g + inter : parts[1].data_ptr<T>();
  const int64_t ldg = parts[0].size(1), ldu = parts.size() == 1 ? ldg : parts[1].size(1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inter; ++c)
      h[r * inter + c] = T(splitserve::silu(float(g[r * ldg + c])) * float(u[r * ldu + c]));
}

template <typename T>
std::optional<at::Tensor> fused(const at::Tensor& x,
                                const std::vector<const QuantExperts*>& gate_up,
                                const QuantExperts& down, const at::Tensor& ids,
                                const at::Tensor& weights, int64_t experts) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const auto r = splitserve::moe::route(ids.data_ptr<int64_t>(), weights.data_ptr<float>(),
                                        tokens * top_k, top_k, experts);
  const int64_t pairs = r.start.back();
  at::Tensor out = x.new_zeros({tokens, hidden});
  if (pairs == 0) return out;
  at::Tensor y = x.new_empty({pairs, hidden}, at::kFloat);
  float* yp = y.data_ptr<float>();
  const at::Tensor token = at::from_blob(const_cast<int64_t*>(r.token.data()), {pairs},
                                         at::TensorOptions().dtype(at::kLong));
  std::atomic<bool> declined{false};
  auto run_expert = [&](int64_t e) {
    const int64_t p0 = r.start[e], rows = r.rows(e);
    const at::Tensor xe = x.index_select(0, token.narrow(0, p0, rows));
    std::vector<at::Tensor> parts;
    for (const QuantExperts* part : gate_up) {
      auto out = part->apply(xe, e);
      if (!out) return declined.store(true);
      parts.push_back(*out);
    }
    const int64_t inter = parts.size() == 1 ? parts[0].size(1) / 2 : parts[0].size(1);
    at::Tensor h = x.new_empty({rows, inter});
    silu_mul<T>(parts, inter, h.data_ptr<T>());
    const auto ye = down.apply(h, e);
    if (!ye) return declined.store(true);
    const T* src = ye->data_ptr<T>();
    for (int64_t row = 0; row < rows; ++row) {
      const float w = r.weight[p0 + row];
      float* dst = yp + (p0 + row) * hidden;
      for (int64_t c = 0; c < hidden; ++c) dst[c] = w * float(src[row * hidden + c]);
    }
  };
  const auto& active = r.active;  // most pairs first
  if (int64_t(active.size()) >= at::get_num_threads()) {
    std::atomic<size_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (size_t i = next++; i < active.size() && !declined; i = next++) run_expert(active[i]);
    });
  } else {
    for (int64_t e : active) run_expert(e);
  }
  if (declined) return std::nullopt;

  // Each token's pairs, in expert order.
  std::vector<int64_t> first(tokens + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++first[r.token[p] + 1];
  for (int64_t t = 0; t < tokens; ++t) first[t + 1] += first[t];
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[fill[r.token[p]]++] = p;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 8192 / hidden), [&](int64_t b, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = b; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t i = first[t]; i < first[t + 1]; ++i) {
        const float* row = yp + order[i] * hidden;
        for (int64_t c = 0; c < hidden; ++c) sum[c] += row[c];
      }
      for (int64_t c = 0; c < hidden; ++c) op[t * hidden + c] = T(sum[c]);
    }
  });
  return out;
}

}  // namespace

namespace splitserve::quant_moe {

std::optional<at::Tensor> fused_quant_experts(const at::Tensor& x,
                                              const std::vector<const QuantExperts*>& gate_up,
                                              const QuantExperts& down,
                                              const at::Tensor& topk_weights,
                                              const at::Tensor& topk_ids, int64_t experts) {
  const auto dtype = x.scalar_type();
  if (!x.device().is_cpu() || !topk_ids.device().is_cpu() || !topk_weights.device().is_cpu())
    return std::nullopt;
  TORCH_CHECK_VALUE(x.dim() == 2 && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                        topk_weights.sizes() == topk_ids.sizes(),
                    "fused_quant_experts takes x [T, H], topk_ids and topk_weights [T, k]; got ",
                    x.sizes(), ", ", topk_ids.sizes(), ", ", topk_weights.sizes());
  TORCH_CHECK_VALUE(gate_up.size() == 1 || gate_up.size() == 2, "gate_up has 1 or 2 parts");
  TORCH_CHECK_VALUE(experts > 0, "experts must be > 0");
  const at::Tensor xc = x.contiguous(), ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  switch (dtype) {
    case at::kFloat: return fused<float>(xc, gate_up, down, ids, weights, experts);
    case at::kBFloat16: return fused<at::BFloat16>(xc, gate_up, down, ids, weights, experts);
    case at::kHalf: return fused<at::Half>(xc, gate_up, down, ids, weights, experts);
    default: return std::nullopt;
  }
}

}  // namespace splitserve::quant_moe
