// Fused elementwise CPU kernels of models/layers: RMSNorm (with the residual add), neox
// rotary embedding of q and k in place, SiLU-and-mul. One pass per row, parallel over
// rows, math in float32. Results are rounded to the tensor dtype exactly where the torch
// code (models/layers/*.py, as transformers) stores a tensor, so both paths agree
// bitwise: see `round_to` (cpu_ops.h) and `sum_of_squares`.
//
// The kernels take CPU tensors of float32, bfloat16 or float16 with 1-3 dimensions and a
// contiguous last dimension (rows may be strided); each returns None (false for the
// in-place ones), touching nothing, for tensors it does not take, and the layer runs its
// torch code. Arguments that do not fit together raise.

#include "torch_ext.h"
#include "cpu_ops.h"
#include "cpu_api.h"

#include <cmath>
#include <optional>

namespace {

using namespace splitserve::fused;

// sum(x^2) as torch computes `x.float().pow(2).sum(-1)` (ATen SumKernel.cpp), so that the
// variance, and the norm, agree bitwise with the torch code. torch reads the row as vectors
// of 8 lanes (the width of its AVX2 kernel, which it runs on AVX512 CPUs too, and of its
// default one), four at a time into four accumulators; here those four are one Block of
// 32 lanes. Accumulators cascade over levels of 2^power blocks; the vectors left over go
// into the first accumulator, the elements left over and then the 8 lanes into the total.
// A float32 square is fenced, as torch stores it: else an FMA could fuse it into the sum
// (the square of a bf16 or fp16 value is exact, so fusing would not change that sum).
constexpr int64_t kLanes = 8, kBlock = 4 * kLanes;

static_assert(kBlock % kStep == 0, "a block is whole steps");

struct Block {
  Floats v[kBlock / kStep];
  Block operator+(const Block& other) const {
    Block sum;
    for (int64_t i = 0; i < kBlock / kStep; ++i) {
      sum.v[i] = v[i] + other.v[i];
    }
    return sum;
  }
};

template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  auto square = [](float v) { return fence(v * v); };
  if (n < kLanes) {  // torch's scalar path: four accumulators, then the rest into the first
    float acc[4] = {};
    const int64_t full = n / 4 * 4;
    for (int64_t i = 0; i < full; ++i) {
      acc[i % 4] = acc[i % 4] + square(float(x[i]));
    }
    for (int64_t i = full; i < n; ++i) {
      acc[0] = acc[0] + square(float(x[i]));
    }
    return ((acc[0] + acc[1]) + acc[2]) + acc[3];
  }
  const int64_t vectors = n / kLanes, blocks = vectors / 4;
  const int64_t ceil_log2 = blocks <= 2 ? 1 : 64 - __builtin_clzll(uint64_t(blocks - 1));
  const int64_t power = std::max<int64_t>(4, ceil_log2 / 4);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  auto load = [&](int64_t block) {
    Block squares;
    for (int64_t i = 0; i < kBlock / kStep; ++i) {
      const Floats v = vload(x + block * kBlock + i * kStep);
      squares.v[i] = std::is_same_v<T, float> ? fence(v * v) : v * v;
    }
    return squares;
  };
  Block acc[4] = {};  // the levels
  int64_t b = 0;
  while (b + step <= blocks) {
    for (int64_t j = 0; j < step; ++j, ++b) {
      acc[0] = acc[0] + load(b);
    }
    for (int64_t level = 1; level < 4; ++level) {
      acc[level] = acc[level] + acc[level - 1];
      acc[level - 1] = Block{};
      if ((b & (mask << (level * power))) != 0) {
        break;
      }
    }
  }
  for (; b < blocks; ++b) {
    acc[0] = acc[0] + load(b);
  }
  for (int64_t level = 1; level < 4; ++level) {
    acc[0] = acc[0] + acc[level];
  }
  float lanes[kBlock];
  for (int64_t i = 0; i < kBlock / kStep; ++i) {
    vstore(lanes + i * kStep, acc[0].v[i]);
  }
  for (int64_t i = blocks * kBlock; i < vectors * kLanes; ++i) {
    lanes[i % kLanes] = lanes[i % kLanes] + square(float(x[i]));
  }
  for (int64_t k = 1; k < 4; ++k) {
    for (int64_t l = 0; l < kLanes; ++l) {
      lanes[l] = lanes[l] + lanes[k * kLanes + l];
    }
  }
  float total = 0;
  for (int64_t i = vectors * kLanes; i < n; ++i) {
    total = total + square(float(x[i]));
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    total = total + lanes[l];
  }
  return total;
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), as RMSNorm's torch code rounds it.
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  const float variance = sum_of_squares(x, n) / float(n);
  const Floats scale(1.0f / std::sqrt(variance + eps));
  for (int64_t i = 0; i < n; i += kStep) {
    const int64_t count = std::min(kStep, n - i);
    const Floats normed = round_to<T>(vload(x + i, count) * scale);
    vstore(out + i, vload(weight + i, count) * normed, count);
  }
}

// Whether the norm kernels take rows x with this weight: [hidden], contiguous, x's dtype
// (the torch code promotes another).
bool takes_norm(const at::Tensor& x, const at::Tensor& weight) {
  return takes_rows(x) && weight.device().is_cpu() && weight.dim() == 1 &&
         weight.is_contiguous() && weight.size(0) == x.size(-1) &&
         weight.scalar_type() == x.scalar_type();
}

// Neox rotation of each head of one token: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
// over lanes [j, j + count) of each half, every product and sum rounded to T as torch does.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_dim, int64_t j, int64_t count,
                  const Floats& cos, const Floats& sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_dim + j;
    T* x2 = x1 + half;
    const Floats a = vload(x1, count), b = vload(x2, count);
    vstore(x1, round_to<T>(a * cos) - round_to<T>(b * sin), count);
    vstore(x2, round_to<T>(b * cos) + round_to<T>(a * sin), count);
  }
}

// Like torch's silu, the vector exp covers whole blocks of two vectors of T and std::exp
// the rest of a row.
fVec silu_of(const fVec& g) { return g / (fVec(1.0f) + g.neg().exp()); }

}  // namespace

namespace splitserve::ops {

std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                      double eps) {
  if (!takes_norm(x, weight)) return std::nullopt;
  auto out = x.new_empty(x.sizes());
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> in(x), result(out);
    const T* w = weight.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row(in[r], w, result[r], n, float(eps));
      }
    });
  });
  return out;
}

// sum = x + residual, out = norm(sum). out may be x and sum may be residual (in place, as
// vLLM's fused_add_rms_norm): each row is read before it is written.
bool add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps, const at::Tensor& out,
                  const at::Tensor& sum) {
  if (!takes_norm(x, weight) || !take_like(x, {&residual, &out, &sum})) return false;
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> xs(x), res(residual), outs(out), sums(sum);
    const T* w = weight.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *a = xs[r], *b = res[r];
        T* s = sums[r];
        for (int64_t i = 0; i < n; i += kStep) {
          const int64_t count = std::min(kStep, n - i);
          vstore(s + i, vload(a + i, count) + vload(b + i, count), count);
        }
        norm_row(s, w, outs[r], n, float(eps));
      }
    });
  });
  return true;
}


// Rotates q [T, heads * head_dim] and k [T, kv_heads * head_dim] in place by the float32
// cos/sin caches [max_position, head_dim / 2] at positions [T] (cos/sin rounded to T first).
// Every position is checked before any row is written.
bool rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache, int64_t head_dim) {
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be a contiguous int64 CPU vector");
  const int64_t tokens = positions.size(0), half = head_dim / 2;
  if (head_dim <= 0 || head_dim % 2 != 0) return false;
  for (const auto* t : {&q, &k})
    if (!takes_rows(*t) || t->dim() != 2 || t->size(0) != tokens || t->size(1) % head_dim != 0 ||
        t->scalar_type() != q.scalar_type())
      return false;
  for (const auto* t : {&cos_cache, &sin_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->dim() == 2 && t->size(1) == half,
                "cos/sin caches must be contiguous float32 [max_position, head_dim / 2]");
  }
  const int64_t max_position = cos_cache.size(0);
  const int64_t q_heads = q.size(1) / head_dim, k_heads = k.size(1) / head_dim;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " out of range");
  const float *cos_base = cos_cache.data_ptr<float>(), *sin_base = sin_cache.data_ptr<float>();
  dispatch(q, [&](auto tag) {
    using T = decltype(tag);
    T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
    const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
    at::parallel_for(0, tokens, grain((q_heads + k_heads) * head_dim), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        for (int64_t j = 0; j < half; j += kStep) {
          const int64_t count = std::min(kStep, half - j);
          const Floats cos = round_to<T>(vload(cos_base + pos[t] * half + j, count));
          const Floats sin = round_to<T>(vload(sin_base + pos[t] * half + j, count));
          rotate_heads(qp + t * q_stride, q_heads, head_dim, j, count, cos, sin);
          rotate_heads(kp + t * k_stride, k_heads, head_dim, j, count, cos, sin);
        }
      }
    });
  });
  return true;
}
// x = [gate; up] along the last dimension -> T(T(silu(gate)) * up).

std::optional<at::Tensor> silu_and_mul(const at::Tensor& x) {
  if (!takes_rows(x) || x.size(-1) % 2 != 0) return std::nullopt;
  const int64_t d = x.size(-1) / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = x.new_empty(sizes);
  const int64_t rows = d == 0 ? 0 : out.numel() / d;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> in(x), result(out);
    const int64_t vector_end = d - d % (2 * at::vec::Vectorized<T>::size());
    at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *gate = in[r], *up = gate + d;
        T* o = result[r];
        for (int64_t i = 0; i < vector_end; i += kStep) {
          const Floats g = vload(gate + i);
          const Floats silu = round_to<T>({silu_of(g.lo), silu_of(g.hi)});
          vstore(o + i, silu * vload(up + i));
        }
        for (int64_t i = vector_end; i < d; ++i) {
          const float g = float(gate[i]);
          const T silu = T(g / (1.0f + std::exp(-g)));
          o[i] = T(float(silu) * float(up[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace splitserve::ops
