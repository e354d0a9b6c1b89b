// The Python face of the kernels only quantized models run (kernels/libraries.py,
// QUANT_KERNELS): one submodule per kernel file, as kernels.cpp does for the others.
#include "torch_ext.h"
#include "pybind_ext.h"
#include "cpu_api.h"
#include "../../models/quantization/cpu_quant_moe.h"

#include <memory>
#include <optional>
#include <string>

namespace {

namespace api = splitserve::api;
namespace quant = splitserve::quant;
using py::arg;

void bind_quant_linear(py::module_ m) {
  const auto linear = [&m](const char* name, api::QuantLinear kernel, const char* doc) {
    m.def(name, kernel, doc, arg("x"), arg("qweight"), arg("scales"), arg("mins"), arg("bits"),
          arg("block_size"), arg("bias") = py::none());
  };
  linear("linear_f32", &quant::linear_f32, "x (float32) W^T (+ bias), W dequantized in registers");
  linear("linear_int8", &quant::linear_int8,
         "x (fp32/bf16/fp16) W^T (+ bias), x quantized to int8 per 32");
  linear("linear_bf16", &quant::linear_bf16,
         "x (bf16) W^T (+ bias), W dequantized to bf16 tiles in registers");
  linear("strip_linear_f32", &quant::strip_linear_f32, "linear_f32 on a weight in strips");
  linear("strip_linear_int8", &quant::strip_linear_int8, "linear_int8 on a weight in strips");
  m.def("strip_dequantize_into", &quant::strip_dequantize_into,
        "dequantize_into from a weight in strips", arg("out"), arg("q"), arg("scales"),
        arg("mins"), arg("bits"), arg("block_size"));
  m.def("strip_width", &quant::strip_width,
        "features per strip where the build computes on strips, else 0");
  m.def("dequantize_into", &quant::dequantize_into, "writes W into out (float32/bf16/fp16)",
        arg("out"), arg("qweight"), arg("scales"), arg("mins"), arg("bits"), arg("block_size"));
  m.def("c_api", [] {
    py::dict lent;
    lent["linear_int8"] = api::lend(&quant::linear_int8, "splitserve.linear_int8");
    lent["strip_linear_int8"] =
        api::lend(&quant::strip_linear_int8, "splitserve.strip_linear_int8");
    lent["linear_f32"] = api::lend(&quant::linear_f32, "splitserve.linear_f32");
    lent["strip_linear_f32"] = api::lend(&quant::strip_linear_f32, "splitserve.strip_linear_f32");
    return lent;
  }, "these kernels for other C++ modules (kernels/cpu_api.h)");
}

void bind_fp8_linear(py::module_ m) {
  namespace fp8 = splitserve::fp8;
  m.def("linear", &fp8::linear, "x (scale * W)^T (+ bias) for float8_e4m3fn W given as uint8",
        arg("x"), arg("weight"), arg("scale"), arg("bias") = py::none());
  m.def("dequantize", &fp8::dequantize, "scale * W as a dense tensor of dtype", arg("weight"),
        arg("scale"), arg("dtype"));
  m.def("c_api", [] {
    py::dict lent;
    lent["fp8_linear"] = api::lend(&fp8::linear, "splitserve.fp8_linear");
    lent["fp8_dequantize"] = api::lend(&fp8::dequantize, "splitserve.fp8_dequantize");
    return lent;
  }, "these kernels for other C++ modules (kernels/cpu_api.h)");
}

void bind_quant_moe(py::module_ m) {
  using namespace splitserve::quant_moe;
  py::class_<QuantExperts>(m, "QuantExperts", py::module_local());
  py::class_<BlockQuantExperts, QuantExperts>(m, "BlockQuantExperts", py::module_local())
      .def(py::init([](at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                       int64_t bits, int64_t block_size, const py::dict& lent,
                       const std::string& kernel, std::optional<at::Tensor> input_index) {
             return std::make_unique<BlockQuantExperts>(
                 std::move(q), std::move(scales), std::move(mins), bits, block_size,
                 api::borrow<api::QuantLinear>(lent, kernel), std::move(input_index));
           }),
           arg("q"), arg("scales"), arg("mins"), arg("bits"), arg("block_size"), arg("lent"),
           arg("kernel"), arg("input_index") = py::none());
  py::class_<Fp8Experts, QuantExperts>(m, "Fp8Experts", py::module_local())
      .def(py::init([](at::Tensor weight, at::Tensor scale, int64_t small_rows,
                       const py::dict& lent) {
             return std::make_unique<Fp8Experts>(
                 std::move(weight), std::move(scale), small_rows,
                 api::borrow<api::Fp8Linear>(lent, "fp8_linear"),
                 api::borrow<api::Fp8Dequantize>(lent, "fp8_dequantize"));
           }),
           arg("weight"), arg("scale"), arg("small_rows"), arg("lent"));
  m.def("fused_quant_experts", &fused_quant_experts,
        "sum_j weight[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t] on quantized experts; "
        "None if a kernel declines",
        arg("x"), arg("gate_up"), arg("down"), arg("topk_weights"), arg("topk_ids"),
        arg("experts"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_quant_linear(m.def_submodule("quant_linear"));
  bind_fp8_linear(m.def_submodule("fp8_linear"));
  bind_quant_moe(m.def_submodule("quant_moe"));
}
