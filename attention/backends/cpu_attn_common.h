// What the attention kernel files share: cpu_attn.cpp (decode, and the store of a step's
// K/V rows) and cpu_prefill.cpp (prefill). kv_cache is [2, num_blocks, block_size,
// num_kv_heads, head_dim]; storage stays in the cache's dtype (fp8 pages: cpu_attn_fp8.h),
// softmax and accumulation are fp32.
#pragma once

#include "torch_ext.h"

#include "cpu_api.h"
#include "cpu_attn_pages.h"
#include "cpu_math.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) { return splitserve::bf16_to_float(x.x); }

using splitserve::exp_nonpositive;

}  // namespace

#include "cpu_attn_fp8.h"

namespace {

inline bool is_model_dtype(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

// f(T{}) for the dtypes a model computes in (float32, bf16, fp16); float64, which no model
// runs in, is not built.
template <typename F>
void dispatch_model_dtype(at::ScalarType type, const char* name, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, name, " takes float32, bfloat16 or float16, not ", type);
  }
}

// f(C{}) for a page dtype: fp8 (E4M3, E5M2) or one a model computes in.
template <typename F>
void dispatch_page_dtype(at::ScalarType type, const char* name, F&& f) {
  if (type == at::kFloat8_e4m3fn) return f(E4M3{});
  if (type == at::kFloat8_e5m2) return f(E5M2{});
  dispatch_model_dtype(type, name, f);
}

// What turns a page value of C (page units, cpu_attn_fp8.h) into K or V, given the layer's
// scale: the scale times the unit for fp8 pages, 1 for the others.
template <typename C>
float page_multiplier(double scale) {
  return kIsFp8<C> ? float(scale) * kPageUnit<C> : 1.0f;
}

// A query or output row of the model's dtype (float32, bf16 or fp16). The kernels read
// queries into float32 and write outputs from float32 through it, so that each is built once
// per page type, not once per pair of query and page types.
struct ModelRow {
  char* data;
  at::ScalarType type;
  int64_t elem_size;

  static ModelRow of(const at::Tensor& t) {
    return {static_cast<char*>(t.data_ptr()), t.scalar_type(), t.element_size()};
  }
  ModelRow operator+(int64_t elements) const {
    return {data + elements * elem_size, type, elem_size};
  }
  // out[i] = row[i] * mul, i < n.
  void load(int64_t n, float mul, float* out) const {
    dispatch_model_dtype(type, "attention", [&](auto tag) {
      const auto* x = reinterpret_cast<const decltype(tag)*>(data);
      for (int64_t i = 0; i < n; ++i) out[i] = to_float(x[i]) * mul;
    });
  }
  // row[i] = in[i] * mul, i < n.
  void store(const float* in, int64_t n, float mul) const {
    dispatch_model_dtype(type, "attention", [&](auto tag) {
      using T = decltype(tag);
      auto* x = reinterpret_cast<T*>(data);
      for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(in[i] * mul);
    });
  }
};

}  // namespace
