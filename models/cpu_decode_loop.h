// A decode step of a Llama-style decoder's layers in one C++ call (cpu_decode_loop.cpp says
// what it computes; models/cpu_decode_loop.py which models and steps it takes). The binding
// file (kernels/bindings/kernels.cpp) makes it from Python.
#pragma once

#include "torch_ext.h"
#include "cpu_api.h"

#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace splitserve::decode {

// y = x W^T (+ bias): a quantized kernel (`quant`), a dense one (`dense`: float32 math on a
// bf16 W, or a float32 W of few rows, or AMX tiles; at::linear for the rows it declines), or
// at::linear.
struct Linear {
  api::QuantLinear quant = nullptr;
  api::DenseLinear dense = nullptr;
  at::Tensor weight, scales;
  std::optional<at::Tensor> mins, bias;
  int64_t bits = 0, block_size = 0;

  at::Tensor operator()(const at::Tensor& x) const;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  double k_scale, v_scale;
  int64_t window;
};

class DecodeLoop {
 public:
  // The linear layers' kernels, by the names their modules lend them under (c_api()): a
  // QuantLinear or a DenseLinear each (kernels/cpu_api.h).
  using Lent = std::unordered_map<std::string, void*>;

  DecodeLoop(Lent linears, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
             double eps, double scale, at::Tensor cos_cache, at::Tensor sin_cache)
      : linears_(std::move(linears)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), eps_(eps), scale_(scale), cos_cache_(std::move(cos_cache)),
        sin_cache_(std::move(sin_cache)) {}

  // A linear layer: (kernel name or "" for at::linear, weight, scales, mins, bits,
  // block_size, bias), the kernel one of `linears`: quantized given scales, else dense.
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
  std::pair<at::Tensor, at::Tensor> forward(at::Tensor hidden, const at::Tensor& positions,
                                            const std::vector<at::Tensor>& kv_caches,
                                            const at::Tensor& slot_mapping,
                                            const at::Tensor& block_table,
                                            const at::Tensor& seq_lens, const at::Tensor& reqs,
                                            const at::Tensor& rows) const;

 private:
  Linear linear(const LinearArgs& args) const;

  Lent linears_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor cos_cache_, sin_cache_;
  std::vector<Layer> layers_;
};

}  // namespace splitserve::decode
