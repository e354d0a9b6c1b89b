// What a library's binding file (kernels/bindings/) adds to the kernels' torch_ext.h:
// pybind11 with torch's at::Tensor casters, and the capsules by which one library lends
// its functions to another's (cpu_api.h). pybind11 compiles its dispatch code in every file
// that includes it, ~4 s each: hence one binding file per library, its kernel files
// without it. Its code is the binding's few conversions, at -O1 (the kernels keep -O3).
#pragma once

#include "torch_ext.h"

#include <string>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("O1")
#endif
#include <torch/csrc/utils/pybind.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

namespace py = pybind11;

namespace splitserve::api {

// A function as a capsule named `name` ("splitserve.<its key in c_api()>"), for a
// module's `c_api()`.
template <typename F>
py::capsule lend(F function, const char* name) {
  return py::capsule(reinterpret_cast<void*>(function), name);
}

// The function lent as `function` in `lent` (a module's `c_api()`, or several merged), its
// capsule's name checked.
inline void* borrow_pointer(const py::dict& lent, const std::string& function) {
  const std::string name = "splitserve." + function;
  TORCH_CHECK(lent.contains(function), "the kernel module lends no ", function);
  PyObject* capsule = py::object(lent[function.c_str()]).ptr();
  TORCH_CHECK(PyCapsule_IsValid(capsule, name.c_str()), function, " is not a capsule named ",
              name);
  return PyCapsule_GetPointer(capsule, name.c_str());
}

template <typename F>
F borrow(const py::dict& lent, const std::string& function) {
  return reinterpret_cast<F>(borrow_pointer(lent, function));
}

}  // namespace splitserve::api
