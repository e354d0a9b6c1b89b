// What the C++ kernels take from torch: ATen's tensor (its methods), the few ATen
// operators they call, at::parallel_for, and pybind11 with torch's at::Tensor casters.
// <ATen/ATen.h> would declare every operator and <torch/extension.h> add libtorch's C++
// frontend, neither used: the header is precompiled once per ISA (kernels/build.py), and
// its size is that step's time and each file's time to load it. Every file that includes
// pybind11 compiles its dispatch code again; at -O1 that costs each file ~1.5 s less on
// Zen 3 (a binding's call is a few conversions: the kernels it calls keep -O3).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("O1")
#endif
#include <torch/csrc/utils/pybind.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

namespace py = pybind11;
