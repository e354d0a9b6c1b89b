// The row arithmetic of the fused kernels (cpu_ops.cpp): kStep values of a float32,
// bfloat16 or float16 row at a time as float32 vectors (`Floats`, `vload`, `vstore`),
// rounded to the row's dtype where the torch code stores a tensor (`round_to`), rows that
// may be strided (`Rows`), which tensors the kernels take (`takes_rows`, `take_like`) and
// the kernel instance of a tensor's dtype (`dispatch`).
#pragma once

// ATen's vector types take their instruction set from CPU_CAPABILITY_*: the widest the
// build's ISA has, which on the CPU it was probed from is the one torch's runtime dispatch
// picks for SiLU: the same vector width (where its vector part ends) and the same exp.
#if defined(SPLITSERVE_AVX512)
#define CPU_CAPABILITY_AVX512
#elif defined(SPLITSERVE_AVX2)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include "torch_ext.h"

#include <algorithm>
#include <initializer_list>
#include <type_traits>

namespace splitserve::fused {

using fVec = at::vec::Vectorized<float>;
inline constexpr int64_t W = fVec::size();
// Elements per step: one whole vector of bf16/fp16 (partial vector stores cannot forward
// to the loads that follow them, which costs a stall), two of float32.
inline constexpr int64_t kStep = 2 * W;
static_assert(at::vec::Vectorized<at::BFloat16>::size() == kStep, "a bf16 vector is a step");

// Rows of about this many elements or more go to separate threads.
inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements));
}

// kStep values in float32.
struct Floats {
  fVec lo, hi;
  Floats(float v = 0.0f) : lo(v), hi(v) {}
  Floats(const fVec& lo, const fVec& hi) : lo(lo), hi(hi) {}
};

inline Floats operator+(const Floats& a, const Floats& b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline Floats operator-(const Floats& a, const Floats& b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline Floats operator*(const Floats& a, const Floats& b) { return {a.lo * b.lo, a.hi * b.hi}; }

template <typename T>
Floats vload(const T* p, int64_t count = kStep) {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t rest = std::max<int64_t>(count - W, 0);
    return {fVec::loadu(p, std::min(count, W)), fVec::loadu(p + W, rest)};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, count));
    return {lo, hi};
  }
}

template <typename T>
void vstore(T* p, const Floats& v, int64_t count = kStep) {
  if constexpr (std::is_same_v<T, float>) {
    v.lo.store(p, std::min(count, W));
    v.hi.store(p + W, std::max<int64_t>(count - W, 0));
  } else {
    at::vec::convert_from_float<T>(v.lo, v.hi).store(p, count);
  }
}

// v as computed so far, never fused with what follows: the compiler may otherwise
// contract a product and a sum into one FMA, skipping a rounding that torch performs.
template <typename V>
V fence(V v) {
  asm volatile("" : "+m"(v));
  return v;
}

// v as torch would hold it in a tensor of dtype T (rounded to nearest even).
template <typename T>
Floats round_to(const Floats& v) {
  if constexpr (std::is_same_v<T, float>) {
    return fence(v);
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v.lo, v.hi));
    return {lo, hi};
  }
}

// Row r of a tensor [n], [rows0, n] or [rows0, rows1, n] whose rows may be strided.
template <typename T>
struct Rows {
  T* base;
  int64_t rows1, s0, s1;

  explicit Rows(const at::Tensor& t)
      : base(static_cast<T*>(t.data_ptr())),
        rows1(t.dim() == 3 ? t.size(1) : 1),
        s0(t.dim() >= 2 ? t.stride(0) : 0),
        s1(t.dim() == 3 ? t.stride(1) : 0) {}

  T* operator[](int64_t row) const { return base + (row / rows1) * s0 + (row % rows1) * s1; }
};

// Whether the kernels take t as rows.
inline bool takes_rows(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.device().is_cpu() && t.dim() >= 1 && t.dim() <= 3 &&
         (t.stride(-1) == 1 || t.size(-1) <= 1) &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

// Whether the kernels take `others` (residual, outputs) along with rows x: x's shape and
// dtype, rows the kernels take.
inline bool take_like(const at::Tensor& x, std::initializer_list<const at::Tensor*> others) {
  for (const auto* t : others)
    if (!takes_rows(*t) || t->sizes() != x.sizes() || t->scalar_type() != x.scalar_type())
      return false;
  return true;
}

// f(T{}) for t's dtype, one that takes_rows accepted.
template <typename F>
void dispatch(const at::Tensor& t, const F& f) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(at::BFloat16{});
    default:
      return f(at::Half{});
  }
}

}  // namespace splitserve::fused
