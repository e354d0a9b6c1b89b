// The Python face of the kernels only quantized models run (kernels/libraries.py,
// QUANT_KERNELS): one submodule per kernel file, as kernels.cpp does for the others.
#include "torch_ext.h"
#include "python_module.h"
#include "cpu_api.h"
#include "../../models/quantization/cpu_quant_moe.h"

#include <memory>
#include <optional>
#include <string>

namespace {

namespace api = splitserve::api;
namespace quant = splitserve::quant;
using splitserve::python::arg;
using splitserve::python::def;
using splitserve::python::Dict;

template <auto Kernel>
void bind_quant_linear(PyObject* m, const char* name, const char* doc) {
  def<Kernel>(m, name, doc,
              {arg("x"), arg("qweight"), arg("scales"), arg("mins"), arg("bits"),
               arg("block_size"), arg("bias") = std::nullopt});
}

PyObject* quant_c_api() {
  return api::lend({{"linear_int8", "splitserve.linear_int8", &quant::linear_int8},
                    {"strip_linear_int8", "splitserve.strip_linear_int8",
                     &quant::strip_linear_int8},
                    {"linear_f32", "splitserve.linear_f32", &quant::linear_f32},
                    {"strip_linear_f32", "splitserve.strip_linear_f32", &quant::strip_linear_f32}});
}

void bind_quant_linear(PyObject* m) {
  bind_quant_linear<&quant::linear_f32>(m, "linear_f32",
                                        "x (float32) W^T (+ bias), W dequantized in registers");
  bind_quant_linear<&quant::linear_int8>(
      m, "linear_int8", "x (fp32/bf16/fp16) W^T (+ bias), x quantized to int8 per 32");
  bind_quant_linear<&quant::linear_bf16>(
      m, "linear_bf16", "x (bf16) W^T (+ bias), W dequantized to bf16 tiles in registers");
  bind_quant_linear<&quant::strip_linear_f32>(m, "strip_linear_f32",
                                              "linear_f32 on a weight in strips");
  bind_quant_linear<&quant::strip_linear_int8>(m, "strip_linear_int8",
                                               "linear_int8 on a weight in strips");
  const auto dequantize_args = [] {
    return std::vector{arg("out"), arg("qweight"), arg("scales"), arg("mins"), arg("bits"),
                       arg("block_size")};
  };
  def<&quant::strip_dequantize_into>(m, "strip_dequantize_into",
                                     "dequantize_into from a weight in strips", dequantize_args());
  def<&quant::strip_width>(m, "strip_width",
                           "features per strip where the build computes on strips, else 0");
  def<&quant::dequantize_into>(m, "dequantize_into",
                               "writes W into out (float32/bf16/fp16)", dequantize_args());
  def<&quant_c_api>(m, "c_api", "these kernels for other C++ modules (kernels/cpu_api.h)");
}

PyObject* fp8_c_api() {
  return api::lend({{"fp8_linear", "splitserve.fp8_linear", &splitserve::fp8::linear},
                    {"fp8_dequantize", "splitserve.fp8_dequantize", &splitserve::fp8::dequantize}});
}

void bind_fp8_linear(PyObject* m) {
  namespace fp8 = splitserve::fp8;
  def<&fp8::linear>(m, "linear", "x (scale * W)^T (+ bias) for float8_e4m3fn W given as uint8",
                    {arg("x"), arg("weight"), arg("scale"), arg("bias") = std::nullopt});
  def<&fp8::dequantize>(m, "dequantize", "scale * W as a dense tensor of dtype",
                        {arg("weight"), arg("scale"), arg("dtype")});
  def<&fp8_c_api>(m, "c_api", "these kernels for other C++ modules (kernels/cpu_api.h)");
}

using splitserve::quant_moe::QuantExperts;

std::unique_ptr<QuantExperts> make_block_quant_experts(
    at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins, int64_t bits,
    int64_t block_size, Dict lent, const std::string& kernel,
    std::optional<at::Tensor> input_index) {
  return std::make_unique<splitserve::quant_moe::BlockQuantExperts>(
      std::move(q), std::move(scales), std::move(mins), bits, block_size,
      api::borrow<api::QuantLinear>(lent, kernel), std::move(input_index));
}

std::unique_ptr<QuantExperts> make_fp8_experts(at::Tensor weight, at::Tensor scale,
                                               int64_t small_rows, Dict lent) {
  return std::make_unique<splitserve::quant_moe::Fp8Experts>(
      std::move(weight), std::move(scale), small_rows,
      api::borrow<api::Fp8Linear>(lent, "fp8_linear"),
      api::borrow<api::Fp8Dequantize>(lent, "fp8_dequantize"));
}

void bind_quant_moe(PyObject* m) {
  splitserve::python::make_class<QuantExperts>(m, "QuantExperts");
  def<&make_block_quant_experts>(
      m, "BlockQuantExperts", "block-quantized experts for fused_quant_experts",
      {arg("q"), arg("scales"), arg("mins"), arg("bits"), arg("block_size"), arg("lent"),
       arg("kernel"), arg("input_index") = std::nullopt});
  def<&make_fp8_experts>(m, "Fp8Experts", "fp8 experts for fused_quant_experts",
                         {arg("weight"), arg("scale"), arg("small_rows"), arg("lent")});
  def<&splitserve::quant_moe::fused_quant_experts, true>(
      m, "fused_quant_experts",
      "sum_j weight[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t] on quantized experts; None "
      "if a kernel declines",
      {arg("x"), arg("gate_up"), arg("down"), arg("topk_weights"), arg("topk_ids"),
       arg("experts")});
}

}  // namespace

SPLITSERVE_PYTHON_MODULE(m) {
  using splitserve::python::submodule;
  bind_quant_linear(submodule(m, "quant_linear"));
  bind_fp8_linear(submodule(m, "fp8_linear"));
  bind_quant_moe(submodule(m, "quant_moe"));
}
