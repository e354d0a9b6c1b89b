// What the C++ kernels take from torch: ATen's tensors and operators, at::parallel_for, and
// pybind11 with torch's at::Tensor casters. <torch/extension.h> would add all of libtorch's
// C++ frontend, which none of them uses: parsing it took ~20 of the ~30 s each kernel file
// took to compile on a 2-core CPU.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
