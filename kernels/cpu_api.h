// The C++ functions one kernel module lends another, as CPython extensions share a C API:
// a module's `c_api()` returns {name: PyCapsule} (`lend`), each capsule named
// "splitserve.<name>" and holding a pointer of the type declared here; the borrower checks
// the name as it takes the pointer (`borrow`). Both sides include this header, so a
// function whose signature drifts from its type no longer compiles. The modules are built
// against one libtorch in one process, which is what makes torch types safe to pass.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

namespace splitserve::api {

// models/layers/cpu_ops.cpp
using RmsNorm = std::optional<torch::Tensor> (*)(const torch::Tensor& x,
                                                 const torch::Tensor& weight, double eps);
using AddRmsNorm = bool (*)(const torch::Tensor& x, const torch::Tensor& residual,
                            const torch::Tensor& weight, double eps, const torch::Tensor& out,
                            const torch::Tensor& sum);
using RotaryEmbedding = bool (*)(const torch::Tensor& positions, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& cos_cache,
                                 const torch::Tensor& sin_cache, int64_t head_dim);
using SiluAndMul = std::optional<torch::Tensor> (*)(const torch::Tensor& x);

// attention/backends/cpu_attn.cpp
using StoreKV = bool (*)(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache,
                         torch::Tensor slot_mapping, double k_scale, double v_scale);
using PagedDecode = void (*)(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache,
                             torch::Tensor block_table, torch::Tensor seq_lens,
                             torch::Tensor reqs, torch::Tensor rows, double scale,
                             int64_t window, double k_scale, double v_scale);

// models/quantization/cpu_quant_*.cpp: linear_int8 (rows) and strip_linear_int8 (strips)
using QuantLinear = std::optional<torch::Tensor> (*)(
    const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
    const std::optional<torch::Tensor>& mins, int64_t bits, int64_t block_size,
    const std::optional<torch::Tensor>& bias);

template <typename F>
pybind11::capsule lend(F function, const char* name) {
  return pybind11::capsule(reinterpret_cast<void*>(function), name);
}

template <typename F>
F borrow(const pybind11::dict& api, const char* function) {
  const std::string name = std::string("splitserve.") + function;
  TORCH_CHECK(api.contains(function), "the kernel module lends no ", function);
  PyObject* capsule = pybind11::object(api[function]).ptr();
  TORCH_CHECK(PyCapsule_IsValid(capsule, name.c_str()), function, " is not a capsule named ",
              name);
  return reinterpret_cast<F>(PyCapsule_GetPointer(capsule, name.c_str()));
}

}  // namespace splitserve::api
