// A decode step of a Llama-style decoder's layers in one call (models/cpu_decode_loop.py
// says which models and steps it takes). It calls the kernels the layers' Python calls, in
// the same order, on the same tensors (kernels/cpu_api.h; the linear layers' kernels as
// their modules lend them): the output is bitwise the one of the Python layers. What it
// saves is the Python between the kernels, about a hundred microseconds a layer on a small
// model, which is most of a single-stream step besides reading the weights.
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
#include "cpu_decode_loop.h"

namespace splitserve::decode {

namespace {

void check(bool taken, const char* kernel) {
  TORCH_CHECK(taken, "decode loop: ", kernel, " declined its tensors");
}

}  // namespace

at::Tensor Linear::operator()(const at::Tensor& x) const {
  if (quant == nullptr && dense == nullptr) return at_linear(x, weight, bias);
  if (dense != nullptr) {
    auto out = dense(x, weight, bias);
    return out.has_value() ? *std::move(out) : at_linear(x, weight, bias);
  }
  auto out = quant(x, weight, scales, mins, bits, block_size, bias);
  TORCH_CHECK(out.has_value(), "decode loop: a quantized linear kernel declined x");
  return *std::move(out);
}

std::pair<at::Tensor, at::Tensor> DecodeLoop::forward(
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
      auto normed = ops::rms_norm(hidden, L.input_norm, eps_);
      TORCH_CHECK(normed.has_value(), "decode loop: rms_norm declined");
      hidden = *std::move(normed);
    } else {
      check(ops::add_rms_norm(hidden, residual, L.input_norm, eps_, hidden, residual),
            "add_rms_norm");
    }
    const at::Tensor qkv = L.qkv(hidden);
    const at::Tensor q = qkv.narrow(1, 0, q_size);
    const at::Tensor k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    check(ops::rotary_embedding(positions, q, k, cos_cache_, sin_cache_, head_dim_),
          "rotary_embedding");
    const at::Tensor k3 = k.view({T, num_kv_heads_, head_dim_});
    const at::Tensor v3 = v.view({T, num_kv_heads_, head_dim_});
    check(attn::store_kv(k3, v3, kv_caches[i], slot_mapping, L.k_scale, L.v_scale), "store_kv");
    const at::Tensor q3 = q.view({T, num_heads_, head_dim_});
    at::Tensor context = hidden.new_empty({T, num_heads_, head_dim_});
    attn::paged_decode(context, q3, kv_caches[i], block_table, seq_lens, reqs, rows, scale_,
                       L.window, L.k_scale, L.v_scale);
    hidden = L.o(context.view({T, q_size}));
    check(ops::add_rms_norm(hidden, residual, L.post_norm, eps_, hidden, residual),
          "add_rms_norm");
    auto act = ops::silu_and_mul(L.gate_up(hidden));
    TORCH_CHECK(act.has_value(), "decode loop: silu_and_mul declined");
    hidden = L.down(*act);
  }
  return {hidden, residual};
}

Linear DecodeLoop::linear(const LinearArgs& args) const {
  const auto& [kernel, weight, scales, mins, bits, block_size, bias] = args;
  Linear out;
  out.weight = weight;
  out.bias = bias;
  if (kernel.empty()) return out;
  const auto lent = linears_.find(kernel);
  TORCH_CHECK(lent != linears_.end(), "the kernel modules lend no ", kernel);
  if (!scales.has_value()) {
    out.dense = reinterpret_cast<api::DenseLinear>(lent->second);
    return out;
  }
  out.quant = reinterpret_cast<api::QuantLinear>(lent->second);
  out.scales = *scales;
  out.mins = mins;
  out.bits = bits;
  out.block_size = block_size;
  return out;
}

}  // namespace splitserve::decode
