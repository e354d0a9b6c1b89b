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
#include "cpu_api.h"
#include "cpu_math.h"
#include "moe_routing.h"

#include <atomic>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace api = splitserve::api;

// One projection of every local expert, stacked, with the kernel that computes on it.
struct QuantExperts {
  virtual ~QuantExperts() = default;
  // x [rows, K] times expert e's weight; nullopt where the kernel declines x.
  virtual std::optional<at::Tensor> apply(const at::Tensor& x, int64_t e) const = 0;
};

// Block-quantized: q [E, ...], scales [E, ...] (mins the same), in the rows or the strips
// layout, computed by the lent kernel named `kernel`; with input_index [E, K] (GPTQ
// act-order), expert e's input feature j is x's feature input_index[e, j].
struct BlockQuantExperts : QuantExperts {
  at::Tensor q, scales;
  std::optional<at::Tensor> mins, input_index;
  int64_t bits, block_size;
  api::QuantLinear linear;

  BlockQuantExperts(at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                    int64_t bits, int64_t block_size, const py::dict& lent,
                    const std::string& kernel, std::optional<at::Tensor> input_index)
      : q(std::move(q)), scales(std::move(scales)), mins(std::move(mins)),
        input_index(std::move(input_index)), bits(bits), block_size(block_size),
        linear(api::borrow<api::QuantLinear>(lent, kernel.c_str())) {}

  std::optional<at::Tensor> apply(const at::Tensor& x, int64_t e) const override {
    const auto m = mins ? std::optional<at::Tensor>(mins->select(0, e)) : std::nullopt;
    const at::Tensor xe = input_index ? x.index_select(1, input_index->select(0, e)) : x;
    return linear(xe, q.select(0, e), scales.select(0, e), m, bits, block_size, std::nullopt);
  }
};

// fp8 e4m3 (as uint8) [E, N, K] with a float32 scale per output feature [E, N]: up to
// `small_rows` rows through the fp8 kernel, more through a matmul on the dequantized
// weight (as cpu_fp8_linear.py's fp8_linear).
struct Fp8Experts : QuantExperts {
  at::Tensor weight, scale;
  int64_t small_rows;
  api::Fp8Linear linear;
  api::Fp8Dequantize dequantize;

  Fp8Experts(at::Tensor weight, at::Tensor scale, int64_t small_rows, const py::dict& lent)
      : weight(std::move(weight)), scale(std::move(scale)), small_rows(small_rows),
        linear(api::borrow<api::Fp8Linear>(lent, "fp8_linear")),
        dequantize(api::borrow<api::Fp8Dequantize>(lent, "fp8_dequantize")) {}

  std::optional<at::Tensor> apply(const at::Tensor& x, int64_t e) const override {
    const at::Tensor w = weight.select(0, e), s = scale.select(0, e);
    if (x.size(0) <= small_rows) return linear(x, w, s, std::nullopt);
    return at::linear(x, dequantize(w, s, x.scalar_type()));
  }
};

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
std::optional<at::Tensor> fused(const at::Tensor& x, const std::vector<const QuantExperts*>& gate_up,
                                const QuantExperts& down, const at::Tensor& ids,
                                const at::Tensor& weights, int64_t experts) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const auto r = splitserve::moe::route(ids.data_ptr<int64_t>(), weights.data_ptr<float>(),
                                        tokens * top_k, top_k, experts);
  const int64_t pairs = r.start.back();
  at::Tensor out = at::zeros({tokens, hidden}, x.options());
  if (pairs == 0) return out;
  at::Tensor y = at::empty({pairs, hidden}, x.options().dtype(at::kFloat));
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
    at::Tensor h = at::empty({rows, inter}, x.options());
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<QuantExperts>(m, "QuantExperts");
  py::class_<BlockQuantExperts, QuantExperts>(m, "BlockQuantExperts")
      .def(py::init<at::Tensor, at::Tensor, std::optional<at::Tensor>, int64_t, int64_t,
                    const py::dict&, const std::string&, std::optional<at::Tensor>>(),
           py::arg("q"), py::arg("scales"), py::arg("mins"), py::arg("bits"),
           py::arg("block_size"), py::arg("lent"), py::arg("kernel"),
           py::arg("input_index") = py::none());
  py::class_<Fp8Experts, QuantExperts>(m, "Fp8Experts")
      .def(py::init<at::Tensor, at::Tensor, int64_t, const py::dict&>(), py::arg("weight"),
           py::arg("scale"), py::arg("small_rows"), py::arg("lent"));
  m.def("fused_quant_experts", &fused_quant_experts,
        "sum_j weight[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t] on quantized experts; "
        "None if a kernel declines",
        py::arg("x"), py::arg("gate_up"), py::arg("down"), py::arg("topk_weights"),
        py::arg("topk_ids"), py::arg("experts"), py::call_guard<py::gil_scoped_release>());
}
