// fp8 (e4m3fn) weight-only linear layers on CPU: out = x (scale * W)^T (+ bias) with W
// float8_e4m3fn [N, K] (passed as its bytes) and one float32 scale per output feature.
//
// `linear` is for the few rows of a decode step: weight rows are converted in pairs, once
// per group of kRowGroup rows of x (they stay in L1 between groups), and multiplied with
// FMA in float32; each weight byte is read from memory once. `dequantize` is for larger
// batches: the weight in the activations' dtype, for a matmul. The widening and the dot
// products: cpu_fp8_tiles.h.

#include "torch_ext.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "cpu_api.h"
#include "cpu_fp8_tiles.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using splitserve::fp8::dot_rows;
using splitserve::fp8::kExponentShift;
using splitserve::fp8::kWeightRows;

constexpr int64_t kBlockBytes = 32 << 10;  // of x (float32) to keep in L1

void check_weight(const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.device().is_cpu() && weight.stride(1) == 1,
              "weight must be the uint8 view of a CPU float8_e4m3fn [N, K] with dense rows");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 &&
                  scale.is_contiguous() && scale.size(0) == weight.size(0),
              "scale must be float32 [N], one per output feature");
}

}  // namespace

namespace splitserve::fp8 {

// x [M, K] (float32, bfloat16 or float16) times the weight, in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  check_weight(weight, scale);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) == weight.size(1),
              "x must be a CPU [M, ", weight.size(1), "] matrix");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto x32 = x.to(at::kFloat).contiguous();
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " values");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  auto out = x32.new_empty({M, N});
  const float* xp = x32.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  const auto* wp = weight.data_ptr<uint8_t>();
  const int64_t w_stride = weight.stride(0);
  float* op = out.data_ptr<float>();
  // The input features go in blocks of at most kBlockBytes of x, which stay in L1 while
  // every weight row of this thread's range passes.
  const int64_t block =
      M * K * 4 <= kBlockBytes ? K : std::max<int64_t>(32, kBlockBytes / (4 * M) / 32 * 32);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sums((end - begin) * M, 0.0f);  // [n - begin][m]
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      const int64_t len = std::min(block, K - k0);
      for (int64_t n = begin; n < end; n += kWeightRows) {
        const uint8_t* w = wp + n * w_stride + k0;
        float* dots = sums.data() + (n - begin) * M;
        if (end - n >= kWeightRows)
          dot_rows<kWeightRows>(w, w_stride, xp + k0, K, len, dots, M);
        else
          dot_rows<1>(w, w_stride, xp + k0, K, len, dots, M);
      }
    }
    for (int64_t n = begin; n < end; ++n) {
      const float s = sp[n] * kExponentShift, b = bp == nullptr ? 0.0f : bp[n];
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = sums[(n - begin) * M + m] * s + b;
    }
  });
  return out.to(x.scalar_type());
}

// scale[n] * weight[n, k] as a dense [N, K] tensor of `dtype`.
at::Tensor dequantize(const at::Tensor& weight, const at::Tensor& scale,
                         at::ScalarType dtype) {
  check_weight(weight, scale);
  const int64_t N = weight.size(0), K = weight.size(1), w_stride = weight.stride(0);
  auto out = weight.new_empty({N, K}, dtype);
  const auto* wp = weight.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const auto& table = splitserve::fp8::kE4m3Table;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_fp8", [&] {
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* w = wp + n * w_stride;
        const float s = sp[n] * kExponentShift;
        int64_t k = 0;
#if defined(SPLITSERVE_FP8_VECTORS)
        using splitserve::fp8::Simd;
        for (; k + 2 * Simd::kLanes <= K; k += 2 * Simd::kLanes) {
          Simd::V lo, hi;
          Simd::widen(w + k, lo, hi);
          Simd::store(row.data() + k, lo);
          Simd::store(row.data() + k + Simd::kLanes, hi);
        }
#endif
        for (; k < K; ++k) row[k] = table[w[k]];
        for (int64_t i = 0; i < K; ++i) op[n * K + i] = static_cast<scalar_t>(row[i] * s);
      }
    });
  });
  return out;
}

}  // namespace splitserve::fp8
