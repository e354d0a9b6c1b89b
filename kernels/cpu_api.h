// The C++ functions one kernel module lends another, as CPython extensions share a C API:
// a module's `c_api()` returns {name: PyCapsule} (`lend`), each capsule named
// "splitserve.<name>" and holding a pointer of the type declared here; the borrower checks
// the name as it takes the pointer (`borrow`). Both sides include this header, so a
// function whose signature drifts from its type no longer compiles. The modules are built
// against one libtorch in one process, which is what makes torch types safe to pass.
#pragma once

#include "torch_ext.h"

#include <optional>
#include <string>

namespace splitserve::api {

// models/layers/cpu_ops.cpp
using RmsNorm = std::optional<at::Tensor> (*)(const at::Tensor& x,
                                                 const at::Tensor& weight, double eps);
using AddRmsNorm = bool (*)(const at::Tensor& x, const at::Tensor& residual,
                            const at::Tensor& weight, double eps, const at::Tensor& out,
                            const at::Tensor& sum);
using RotaryEmbedding = bool (*)(const at::Tensor& positions, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& cos_cache,
                                 const at::Tensor& sin_cache, int64_t head_dim);
using SiluAndMul = std::optional<at::Tensor> (*)(const at::Tensor& x);

// attention/backends/cpu_attn.cpp
using StoreKV = bool (*)(at::Tensor k, at::Tensor v, at::Tensor kv_cache,
                         at::Tensor slot_mapping, double k_scale, double v_scale);
using PagedDecode = void (*)(at::Tensor out, at::Tensor q, at::Tensor kv_cache,
                             at::Tensor block_table, at::Tensor seq_lens,
                             at::Tensor reqs, at::Tensor rows, double scale,
                             int64_t window, double k_scale, double v_scale);

// models/layers/cpu_dense_linear.cpp: x W^T (+ bias) in float32 math for a bf16 W [N, K],
// or a float32 one and few rows; models/layers/cpu_bf16_linear.cpp (AVX-512 BF16 CPUs):
// bf16 x of few rows and a bf16 W; nullopt for tensors they do not take
using DenseLinear = std::optional<at::Tensor> (*)(const at::Tensor& x, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias);

// models/quantization/cpu_quant_*.cpp: linear_int8 and linear_f32 (rows), strip_linear_int8
// and strip_linear_f32 (strips)
using QuantLinear = std::optional<at::Tensor> (*)(
    const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
    const std::optional<at::Tensor>& mins, int64_t bits, int64_t block_size,
    const std::optional<at::Tensor>& bias);

// models/quantization/cpu_fp8_linear.cpp: x (scale * W)^T for W float8_e4m3fn as uint8 [N, K],
// scale float32 [N]; and scale * W dense in a dtype
using Fp8Linear = at::Tensor (*)(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& scale, const std::optional<at::Tensor>& bias);
using Fp8Dequantize = at::Tensor (*)(const at::Tensor& weight, const at::Tensor& scale,
                                     at::ScalarType dtype);

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
