// The experts' weights cpu_quant_moe.cpp computes on, each projection with the kernel
// that multiplies by it (one that models/quantization/cpu_quant_linear.cpp or
// cpu_fp8_linear.cpp lends, kernels/cpu_api.h); its binding file makes them from Python.
#pragma once

#include "torch_ext.h"
#include "cpu_api.h"

#include <optional>
#include <utility>
#include <vector>

namespace splitserve::quant_moe {

// One projection of every local expert, stacked, with the kernel that computes on it.
struct QuantExperts {
  virtual ~QuantExperts() = default;
  // x [rows, K] times expert e's weight; nullopt where the kernel declines x.
  virtual std::optional<at::Tensor> apply(const at::Tensor& x, int64_t e) const = 0;
};

// Block-quantized: q [E, ...], scales [E, ...] (mins the same), in the rows or the strips
// layout, computed by `linear` (a kernel the quantized-linear module lends); with
// input_index [E, K] (GPTQ act-order), expert e's input feature j is x's feature
// input_index[e, j].
struct BlockQuantExperts : QuantExperts {
  at::Tensor q, scales;
  std::optional<at::Tensor> mins, input_index;
  int64_t bits, block_size;
  api::QuantLinear linear;

  BlockQuantExperts(at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                    int64_t bits, int64_t block_size, api::QuantLinear linear,
                    std::optional<at::Tensor> input_index)
      : q(std::move(q)), scales(std::move(scales)), mins(std::move(mins)),
        input_index(std::move(input_index)), bits(bits), block_size(block_size),
        linear(linear) {}

  std::optional<at::Tensor> apply(const at::Tensor& x, int64_t e) const override {
    const auto m = mins ? std::optional<at::Tensor>(mins->select(0, e)) : std::nullopt;
    const at::Tensor xe = input_index ? x.index_select(1, input_index->select(0, e)) : x;
    return linear(xe, q.select(0, e), scales.select(0, e), m, bits, block_size, std::nullopt);
  }
};

// fp8 e4m3 (as uint8) [E, N, K] with a float32 scale per output feature [E, N]: up to
// `small_rows` rows through the fp8 kernel, more through a matmul on the dequantized
// weight (as cpu_fp8_linear.py's fp8_linear).
struct Fp8Experts : QuantExperts {
  at::Tensor weight, scale;
  int64_t small_rows;
  api::Fp8Linear linear;
  api::Fp8Dequantize dequantize;

  Fp8Experts(at::Tensor weight, at::Tensor scale, int64_t small_rows, api::Fp8Linear linear,
             api::Fp8Dequantize dequantize)
      : weight(std::move(weight)), scale(std::move(scale)), small_rows(small_rows),
        linear(linear), dequantize(dequantize) {}

  std::optional<at::Tensor> apply(const at::Tensor& x, int64_t e) const override {
    const at::Tensor w = weight.select(0, e), s = scale.select(0, e);
    if (x.size(0) <= small_rows) return linear(x, w, s, std::nullopt);
    return at_linear(x, dequantize(w, s, x.scalar_type()));
  }
};

// x [T, H] through the experts topk_ids [T, k] name, weighted by topk_weights [T, k]:
// gate_up (one [2I] part or gate and up) and down, of `experts` local experts; nullopt
// where a kernel declines (the caller runs the torch path).
std::optional<at::Tensor> fused_quant_experts(const at::Tensor& x,
                                              const std::vector<const QuantExperts*>& gate_up,
                                              const QuantExperts& down,
                                              const at::Tensor& topk_weights,
                                              const at::Tensor& topk_ids, int64_t experts);

}  // namespace splitserve::quant_moe
