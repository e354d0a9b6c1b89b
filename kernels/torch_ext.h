// What the C++ kernels take from torch: ATen's tensor (its methods), the few ATen
// operators they call and at::parallel_for. <ATen/ATen.h> would declare every operator and
// <torch/extension.h> add libtorch's C++ frontend and pybind11, none used here: the header
// is precompiled once per ISA (kernels/build.py), and its size is that step's time and each
// file's time to load it. Only a library's binding file includes pybind11 (pybind_ext.h).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
