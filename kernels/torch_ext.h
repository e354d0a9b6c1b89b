// What the C++ kernels take from torch: ATen's tensor (its methods, through which they
// make tensors: `x.new_empty(sizes)`), at::from_blob and at::parallel_for. <ATen/ATen.h>
// would declare every operator and <torch/extension.h> add libtorch's C++ frontend and
// pybind11; even one operator's own header (ATen/ops/empty.h) brings ATen/Context.h, which
// doubles this one. It is precompiled once per ISA (kernels/build.py): its size is that
// step's time and each file's time to load it (6.6 s and 0.55 s, against 12.4 s and 1.25 s
// with the operators' headers). Only a library's binding file includes Python
// (python_module.h).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include <optional>

namespace splitserve {

// at::linear for a 2-D x: what it computes there (addmm with a bias, else mm).
inline at::Tensor at_linear(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias = std::nullopt) {
  TORCH_CHECK(x.dim() == 2, "at_linear takes a 2-D x");
  return bias && bias->defined() ? bias->addmm(x, weight.t()) : x.mm(weight.t());
}

}  // namespace splitserve
