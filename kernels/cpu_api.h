// The entry points of the C++ kernel files, as their library's binding file
// (kernels/bindings/) exposes them to Python and other kernels call them. One function of
// a library may also be lent to another library as a C function pointer in a capsule (its
// module's `c_api()`, python_module.h): the pointer types are the functions' own, so a
// signature that drifts no longer compiles. Both libraries are built against one libtorch
// in one process, which is what makes torch types safe to pass.
#pragma once

#include "torch_ext.h"

#include <optional>

namespace splitserve {

// attention/backends/cpu_attn.cpp and cpu_prefill.cpp
namespace attn {
void paged_decode(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_table,
                  at::Tensor seq_lens, at::Tensor reqs, at::Tensor rows, double scale,
                  int64_t window, double k_scale, double v_scale);
bool paged_prefill(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_table,
                   at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor reqs,
                   double scale, int64_t window, double k_scale, double v_scale);
bool store_kv(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slot_mapping,
              double k_scale, double v_scale);
bool has_amx_path();
}  // namespace attn

// models/layers/cpu_ops.cpp
namespace ops {
std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
bool add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                  double eps, const at::Tensor& out, const at::Tensor& sum);
bool rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                      int64_t head_dim);
std::optional<at::Tensor> silu_and_mul(const at::Tensor& x);
}  // namespace ops

// x W^T (+ bias): models/layers/cpu_dense_linear.cpp in float32 math for a bf16 W [N, K],
// or a float32 one (or its panels); models/layers/cpu_bf16_linear.cpp (AVX-512 BF16 CPUs
// without AMX) for bf16 x of few rows and a bf16 W; nullopt for tensors they do not take.
namespace dense {
std::optional<at::Tensor> dense_linear(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias);
std::optional<at::Tensor> pack_weight_panels(const at::Tensor& weight);
}  // namespace dense
namespace bf16 {
std::optional<at::Tensor> dense_linear(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias);
}  // namespace bf16

// models/layers/cpu_linear.cpp (AMX CPUs): bf16 x W^T on AMX tiles, W packed for them
namespace amx_linear {
bool amx_usable();
std::optional<at::Tensor> pack_weight(const at::Tensor& weight);
std::optional<at::Tensor> linear(const at::Tensor& x, const at::Tensor& packed,
                                 const std::optional<at::Tensor>& bias);
}  // namespace amx_linear

// models/layers/cpu_moe.cpp
namespace moe {
std::optional<at::Tensor> fused_experts(const at::Tensor& x, const at::Tensor& w13,
                                        const at::Tensor& w2, const at::Tensor& topk_weights,
                                        const at::Tensor& topk_ids, int64_t chunk_tokens);
}  // namespace moe

// worker/sampler_cpu.cpp
namespace sampler {
at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature,
                  const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                  const std::optional<at::Tensor>& min_p, const at::Tensor& u,
                  double greedy_below);
}  // namespace sampler

// models/quantization/cpu_quant_{linear,tiles,strips}.cpp: x W^T (+ bias) for a
// BlockQuantWeight's q, scales and mins; nullopt where the kernel declines x.
namespace quant {
#define SPLITSERVE_QUANT_LINEAR(name)                                                        \
  std::optional<at::Tensor> name(const at::Tensor& x, const at::Tensor& q,                   \
                                 const at::Tensor& scales, const std::optional<at::Tensor>& mins, \
                                 int64_t bits, int64_t block_size,                           \
                                 const std::optional<at::Tensor>& bias)
SPLITSERVE_QUANT_LINEAR(linear_f32);   // float32 x, W dequantized in registers
SPLITSERVE_QUANT_LINEAR(linear_int8);  // x quantized to int8 per 32
SPLITSERVE_QUANT_LINEAR(linear_bf16);  // bf16 x on the bf16 dot-product instructions
// The same on a weight in strips of 8 features (AVX2 and AVX512-BF16 builds without AMX,
// NEON builds); strip_width() is 8 where they run, else 0.
SPLITSERVE_QUANT_LINEAR(strip_linear_f32);
SPLITSERVE_QUANT_LINEAR(strip_linear_int8);
#undef SPLITSERVE_QUANT_LINEAR
bool dequantize_into(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t bits, int64_t block_size);
bool strip_dequantize_into(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, int64_t bits,
                           int64_t block_size);
int64_t strip_width();
}  // namespace quant

// models/quantization/cpu_fp8_linear.cpp: x (scale * W)^T for W float8_e4m3fn as uint8
// [N, K], scale float32 [N]; and scale * W dense in a dtype
namespace fp8 {
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                  const std::optional<at::Tensor>& bias);
at::Tensor dequantize(const at::Tensor& weight, const at::Tensor& scale, at::ScalarType dtype);
}  // namespace fp8

// The pointer types the decode loop and the quantized experts borrow.
namespace api {
using DenseLinear = decltype(&dense::dense_linear);
using QuantLinear = decltype(&quant::linear_int8);
using Fp8Linear = decltype(&fp8::linear);
using Fp8Dequantize = decltype(&fp8::dequantize);
}  // namespace api

}  // namespace splitserve
