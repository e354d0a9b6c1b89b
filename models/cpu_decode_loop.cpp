// A decode step of a Llama-style decoder's layers in one call (models/cpu_decode_loop.py
// says which models and steps it takes). It calls the kernels the layers' Python calls, in
// the same order, on the same tensors, borrowed from their modules (kernels/cpu_api.h):
// the output is bitwise the one of the Python layers. What it saves is the Python between
// the kernels, about a hundred microseconds a layer on a small model, which is most of a
// single-stream step besides reading the weights.
//
// Per layer, for T decode rows x (the residual stream in `residual`):
//   x, residual = add_rms_norm(x, residual)        (layer 0: residual = x, x = rms_norm(x))
//   q, k, v = split(qkv_proj(x)); rotate q, k in place; store k, v at the slot mapping
//   x = o_proj(paged_decode(q))
//   x, residual = add_rms_norm(x, residual)
//   x = down_proj(silu_and_mul(gate_up_proj(x)))
// A kernel that declines its tensors here is a bug (the Python checked the model and the
// step first), reported as an error.
#include "torch_ext.h"

#include <optional>
#include <utility>
#include <vector>

#include "cpu_api.h"

namespace {

namespace api = splitserve::api;

// y = x W^T (+ bias): a quantized kernel (`quant`), the dense one (`dense`: float32 math on
// a bf16 W, or a float32 W of few rows; at::linear for the rows it declines), or at::linear.
struct Linear {
  api::QuantLinear quant = nullptr;
  api::DenseLinear dense = nullptr;
  at::Tensor weight, scales;
  std::optional<at::Tensor> mins, bias;
  int64_t bits = 0, block_size = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (quant == nullptr && dense == nullptr) return at::linear(x, weight, bias);
    if (dense != nullptr) {
      auto out = dense(x, weight, bias);
      return out.has_value() ? *std::move(out) : at::linear(x, weight, bias);
    }
    auto out = quant(x, weight, scales, mins, bits, block_size, bias);
    TORCH_CHECK(out.has_value(), "decode loop: a quantized linear kernel declined x");
    return *std::move(out);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  double k_scale, v_scale;
  int64_t window;
};

class DecodeLoop {
 public:
  DecodeLoop(const py::dict& ops, const py::dict& attention, const py::dict& linears,
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
             double scale, at::Tensor cos_cache, at::Tensor sin_cache)
      : rms_norm_(api::borrow<api::RmsNorm>(ops, "rms_norm")),
        add_rms_norm_(api::borrow<api::AddRmsNorm>(ops, "add_rms_norm")),
        rotary_(api::borrow<api::RotaryEmbedding>(ops, "rotary_embedding")),
        silu_and_mul_(api::borrow<api::SiluAndMul>(ops, "silu_and_mul")),
        store_kv_(api::borrow<api::StoreKV>(attention, "store_kv")),
        paged_decode_(api::borrow<api::PagedDecode>(attention, "paged_decode")),
        linears_(linears),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale),
        cos_cache_(std::move(cos_cache)),
        sin_cache_(std::move(sin_cache)) {}

  // A linear layer: (kernel name or "" for at::linear, weight, scales, mins, bits,
  // block_size, bias), the kernel one a module lends in `linears`: quantized given scales,
  // else dense.
  using LinearArgs = std::tuple<std::string, at::Tensor, std::optional<at::Tensor>,
                                std::optional<at::Tensor>, int64_t, int64_t,
                                std::optional<at::Tensor>>;

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, const LinearArgs& qkv,
                 const LinearArgs& o, const LinearArgs& gate_up, const LinearArgs& down,
                 double k_scale, double v_scale, int64_t window) {
    layers_.push_back({std::move(input_norm), std::move(post_norm), linear(qkv), linear(o),
                       linear(gate_up), linear(down), k_scale, v_scale, window});
  }

  // hidden [T, hidden_size] (the embeddings; taken over as the residual stream), positions
  // [T] int64, one KV cache per layer, the step's slot mapping, and paged_decode's entries
  // for its T query rows (cpu_backend.DecodeEntries: a decode row, or one token of a short
  // row, each with its own seq_len). Returns (hidden, residual) after the last layer,
  // before the norm.
  std::pair<at::Tensor, at::Tensor> forward(
      at::Tensor hidden, const at::Tensor& positions,
      const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
      const at::Tensor& block_table, const at::Tensor& seq_lens,
      const at::Tensor& reqs, const at::Tensor& rows) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    const int64_t T = hidden.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor residual = hidden;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      if (i == 0) {
        auto normed = rms_norm_(hidden, L.input_norm, eps_);
        TORCH_CHECK(normed.has_value(), "decode loop: rms_norm declined");
        hidden = *std::move(normed);
      } else {
        check(add_rms_norm_(hidden, residual, L.input_norm, eps_, hidden, residual), "add_rms_norm");
      }
      const at::Tensor qkv = L.qkv(hidden);
      const at::Tensor q = qkv.narrow(1, 0, q_size);
      const at::Tensor k = qkv.narrow(1, q_size, kv_size);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
      check(rotary_(positions, q, k, cos_cache_, sin_cache_, head_dim_), "rotary_embedding");
      const at::Tensor k3 = k.view({T, num_kv_heads_, head_dim_});
      const at::Tensor v3 = v.view({T, num_kv_heads_, head_dim_});
      check(store_kv_(k3, v3, kv_caches[i], slot_mapping, L.k_scale, L.v_scale), "store_kv");
      const at::Tensor q3 = q.view({T, num_heads_, head_dim_});
      at::Tensor attn = at::empty({T, num_heads_, head_dim_}, hidden.options());
      paged_decode_(attn, q3, kv_caches[i], block_table, seq_lens, reqs, rows, scale_, L.window,
                    L.k_scale, L.v_scale);
      hidden = L.o(attn.view({T, q_size}));
      check(add_rms_norm_(hidden, residual, L.post_norm, eps_, hidden, residual), "add_rms_norm");
      auto act = silu_and_mul_(L.gate_up(hidden));
      TORCH_CHECK(act.has_value(), "decode loop: silu_and_mul declined");
      hidden = L.down(*act);
    }
    return {hidden, residual};
  }

 private:
  static void check(bool taken, const char* kernel) {
    TORCH_CHECK(taken, "decode loop: ", kernel, " declined its tensors");
  }

  Linear linear(const LinearArgs& args) const {
    const auto& [kernel, weight, scales, mins, bits, block_size, bias] = args;
    Linear out;
    out.weight = weight;
    out.bias = bias;
    if (kernel.empty()) return out;
    if (!scales.has_value()) {
      out.dense = api::borrow<api::DenseLinear>(linears_, kernel.c_str());
      return out;
    }
    out.quant = api::borrow<api::QuantLinear>(linears_, kernel.c_str());
    out.scales = *scales;
    out.mins = mins;
    out.bits = bits;
    out.block_size = block_size;
    return out;
  }

  api::RmsNorm rms_norm_;
  api::AddRmsNorm add_rms_norm_;
  api::RotaryEmbedding rotary_;
  api::SiluAndMul silu_and_mul_;
  api::StoreKV store_kv_;
  api::PagedDecode paged_decode_;
  py::dict linears_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor cos_cache_, sin_cache_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLoop>(m, "DecodeLoop")
      .def(py::init<const py::dict&, const py::dict&, const py::dict&, int64_t, int64_t, int64_t,
                    double, double, at::Tensor, at::Tensor>(),
           py::arg("ops"), py::arg("attention"), py::arg("linears"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("cos_cache"), py::arg("sin_cache"))
      .def("add_layer", &DecodeLoop::add_layer, py::arg("input_norm"), py::arg("post_norm"),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("k_scale"), py::arg("v_scale"), py::arg("window"))
      .def("forward", &DecodeLoop::forward, py::arg("hidden"), py::arg("positions"),
           py::arg("kv_caches"), py::arg("slot_mapping"), py::arg("block_table"),
           py::arg("seq_lens"), py::arg("reqs"), py::arg("rows"),
           py::call_guard<py::gil_scoped_release>());
}
