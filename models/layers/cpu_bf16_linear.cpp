// Dense bf16 linear layers of few rows on CPUs with AVX-512 BF16 but no AMX (Zen 4, Cooper
// Lake): y = x W^T (+ bias) for x bf16 [M, K] (M <= kMaxRows) and W bf16 [N, K] as the layer
// holds it, no copy.
//
// A decode step reads every weight for a few rows; torch's bf16 matmul (oneDNN) read
// SmolLM2's weights at 7.5 GB/s for one row on 2 Zen 4 cores. Here work items of kTile
// output features go to the threads; each multiplies all M rows by its W rows with the
// `vdpbf16ps` tiles of dot_tiles_bf16.h (W streamed from memory once, for the first 4
// rows, prefetching the next item's rows meanwhile), adds the bias in float32 and rounds
// once to bf16, as F.linear does. The function has the DenseLinear signature
// (kernels/cpu_api.h) and lends itself as "bf16_linear", so the decode loop calls it as it
// calls the float32-math dense kernel; it returns None
// (F.linear runs) for what it does not take, and beyond kMaxRows rows, where oneDNN's
// blocking is as fast (measured: 2.2x F.linear at 1 row, 1.9x at 16, 1.2x at 64, 0.9x at
// 128).

#include "torch_ext.h"
#include "cpu_api.h"
#include "dot_tiles.h"

#include <algorithm>
#include <optional>

namespace {

constexpr int64_t kMaxRows = 64;
constexpr int64_t kTile = 32;

}  // namespace

namespace splitserve::bf16 {

std::optional<at::Tensor> dense_linear(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias) {
#if defined(SPLITSERVE_AVX512_BF16)
  const bool takes =
      x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == at::kBFloat16 &&
      weight.scalar_type() == at::kBFloat16 && x.dim() == 2 && weight.dim() == 2 &&
      x.size(0) <= kMaxRows && x.size(1) == weight.size(1) && x.stride(1) == 1 &&
      weight.is_contiguous() &&
      (!bias.has_value() || (bias->device().is_cpu() && bias->dim() == 1 &&
                             bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                             (bias->scalar_type() == at::kBFloat16 ||
                              bias->scalar_type() == at::kFloat)));
  if (!takes) return std::nullopt;
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor out = x.new_empty({rows, n});
  if (rows == 0 || n == 0) return out;
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t lda = x.stride(0), items = (n + kTile - 1) / kTile;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    float y[kMaxRows * kTile];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kTile, cols = std::min(kTile, n - n0);
      const auto ahead = i + 1 < end
                             ? splitserve::dot::Ahead(wp + (n0 + kTile) * k,
                                                      std::min(kTile, n - n0 - kTile) * k)
                             : splitserve::dot::Ahead();
      splitserve::dot::dot_block(xp, lda, rows, wp + n0 * k, k, cols, k, y, kTile, ahead);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          op[r * n + n0 + c] = y[r * kTile + c] + (bp != nullptr ? bp[n0 + c] : 0.0f);
        }
      }
    }
  });
  return out;
#else
  (void)x, (void)weight, (void)bias;
  return std::nullopt;
#endif
}

}  // namespace splitserve::bf16
