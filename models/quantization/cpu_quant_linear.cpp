// Linear layers on block-quantized weights (models/quantization/block_quant.py): out =
// x W^T (+ bias) with W read in its quantized form, parallel over output features.
//
// linear_f32: x float32. Each half-run of a weight row is dequantized to float32 in
// registers exactly as BlockQuantWeight.dequantize computes it, and multiplied into
// float32 accumulators: F.linear(x, w.dequantize()) up to the order of the sums.
// linear_int8: x float32/bfloat16/float16, few rows (decode). x is quantized once per call
// to int8 per 32-run (scale d = max|x| / 127, q = round(x / d)), and each run's dot product with
// the weight is an integer one (VNNI's vpdpbusd, AVX2's maddubs or scalar), scaled by the
// weight's and x's scales into float32 accumulators. A weight's mins add
// mins[n, j] * (sum of dequantized x over block j). Up to 4 rows of x share each run of
// weight unpacked in registers.
// dequantize_into: the weight in x's dtype, for batches large enough for torch's matmul.
//
// Each returns None (or false) for tensors it does not take; the caller then runs torch.

#include "torch_ext.h"
#include <ATen/Parallel.h>

#include "cpu_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "cpu_quant_linear.h"

namespace {

using splitserve::quant::Acts;
using splitserve::quant::ActsStorage;
using splitserve::quant::kRun;
using splitserve::quant::float_bias;
using splitserve::quant::over_runs;
using splitserve::quant::quant_rows;
using splitserve::quant::QuantRows;
using splitserve::quant::takes_x;
using at::Tensor;

constexpr int64_t kMaxRows = 4;  // rows of x one pass over a weight row serves
#if defined(SPLITSERVE_AVX512)
constexpr bool kPairOrder = true;  // the AVX-512 passes read x's runs in pairs
#else
constexpr bool kPairOrder = false;
#endif
constexpr int64_t kGrain = 16;   // output features per task, at least

// out[m + r, n] = res[r] + bias[n] for the `rows` rows a pass computed, over N features
// and rows of x in passes of up to kMaxRows; `pass(n, m, rows, res)` computes one.
template <typename T, typename Pass>
void over_rows(int64_t M, int64_t N, const Tensor& bias, T* out, const Pass& pass) {
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    float res[kMaxRows];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, M - m);
        pass(n, m, rows, res);
        for (int64_t r = 0; r < rows; ++r)
          out[(m + r) * N + n] = static_cast<T>(b == nullptr ? res[r] : res[r] + b[n]);
      }
    }
  });
}

// ---- x float32: dequantize in registers, float32 products -------------------------------

template <int Bits, int R>
void pass_f32(const QuantRows& w, int64_t n, const float* x, int64_t ldx, float* res) {
  using namespace splitserve::quant;
  F16x acc[R][2];
  for (auto& row : acc) row[0] = row[1] = zeros();
  const uint8_t* q = w.q + n * w.row_bytes();
  const int64_t first = n * w.blocks();
  over_runs(w, [&](int64_t k, int64_t j0, int64_t j1) {
    const uint8_t* run = q + (Bits == 4 ? k / 2 : k);
    for (int h = 0; h < 2; ++h) {
      const int64_t j = first + (h ? j1 : j0);
      const float m = w.mins == nullptr ? 0.0f : w.scale(w.mins, j);
      const F16x wv = dequant(Bits == 4 ? q4_half(run, h) : q8_half(run, h),
                              w.scale(w.scales, j), m);
      for (int r = 0; r < R; ++r) acc[r][h] = fma_x(wv, x + r * ldx + k + 16 * h, acc[r][h]);
    }
  });
  for (int r = 0; r < R; ++r) res[r] = sum(add(acc[r][0], acc[r][1]));
}

using PassF32 = void (*)(const QuantRows&, int64_t, const float*, int64_t, float*);
constexpr PassF32 kPassF32[2][kMaxRows] = {
    {pass_f32<4, 1>, pass_f32<4, 2>, pass_f32<4, 3>, pass_f32<4, 4>},
    {pass_f32<8, 1>, pass_f32<8, 2>, pass_f32<8, 3>, pass_f32<8, 4>}};

// ---- x float32/bfloat16/float16: int8 activations, integer dot products -----------------

// res[r] plus the mins term of rows m + r of x: sum over blocks j of mins[j] * sums[j].
inline void add_mins(const QuantRows& w, int64_t first, const Acts& a, int64_t m, int rows,
                     float* res) {
  if (w.mins == nullptr) return;
  const int64_t blocks = w.blocks();
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < blocks; ++j)
      res[r] += w.scale(w.mins, first + j) * a.sums[(m + r) * blocks + j];
}

template <int Bits, int R>
void pass_int8(const QuantRows& w, int64_t n, const Acts& a, int64_t m, float* res) {
  const int64_t K = w.K, first = n * w.blocks();
  const uint8_t* q = w.q + n * w.row_bytes();
  const int8_t* x = a.q + m * K;
#if defined(SPLITSERVE_AVX2)
  using namespace splitserve::quant;
  __m256 acc[R];
  for (auto& v : acc) v = _mm256_setzero_ps();
  // One run k, its halves' scales s0 and s1, into acc (256-bit lanes).
  const auto one_run = [&](int64_t k, float s0, float s1) {
    const __m256 sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
    __m256i u, signs;
    if constexpr (Bits == 4) {
      u = q4_run(q + k / 2);
    } else {
      signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
      u = _mm256_abs_epi8(signs);
    }
    for (int r = 0; r < R; ++r) {
      __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * K + k));
      if constexpr (Bits == 8) av = _mm256_sign_epi8(av, signs);
      const __m256 scale = _mm256_mul_ps(sv, _mm256_set1_ps(a.d[(m + r) * a.runs + k / kRun]));
      const __m256 dots = _mm256_cvtepi32_ps(add_dot4(_mm256_setzero_si256(), u, av));
      acc[r] = _mm256_fmadd_ps(dots, scale, acc[r]);
    }
  };
#if defined(SPLITSERVE_AVX512)
  // Pairs of runs in 512-bit lanes (x is stored in pair order), then an odd last run.
  __m512 wide[R];
  for (auto& v : wide) v = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.pairs; ++p) {
    const int64_t k = 64 * p;
    const __m512 sw =
        pair_scales(w, first, a.half_block[4 * p], a.scale_lanes + 16 * p, a.scale_masks[p]);
    __m512i u;
    __mmask64 negative = 0;
    if constexpr (Bits == 4) {
      u = q4_pair(q + k / 2);
    } else {
      const __m512i v = q8_pair(q + k);
      negative = _mm512_movepi8_mask(v);
      u = _mm512_abs_epi8(v);
    }
    for (int r = 0; r < R; ++r) {
      __m512i av = _mm512_loadu_si512(x + r * K + k);
      if constexpr (Bits == 8) av = _mm512_mask_sub_epi8(av, negative, _mm512_setzero_si512(), av);
      const __m512 scale = _mm512_mul_ps(sw, _mm512_loadu_ps(a.dv + ((m + r) * a.pairs + p) * 16));
      wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_pair(u, av)), scale, wide[r]);
    }
  }
  for (int r = 0; w.mins != nullptr && r < R; ++r)  // the mins term, in the same lanes
    wide[r] = add_dot_scales(w, w.mins, first, a.sums + (m + r) * w.blocks(), w.blocks(), wide[r]);
  for (int r = 0; r < R; ++r) res[r] = _mm512_reduce_add_ps(wide[r]);
  if (K % 64) {
    const int64_t k = K - kRun;
    one_run(k, w.scale(w.scales, first + a.half_block[k / 16]),
            w.scale(w.scales, first + a.half_block[k / 16 + 1]));
    for (int r = 0; r < R; ++r) res[r] += sum8(acc[r]);
  }
#else
  over_runs(w, [&](int64_t k, int64_t j0, int64_t j1) {
    const float s0 = w.scale(w.scales, first + j0);
    one_run(k, s0, j1 == j0 ? s0 : w.scale(w.scales, first + j1));
  });
  for (int r = 0; r < R; ++r) res[r] = sum8(acc[r]);
  add_mins(w, first, a, m, R, res);
#endif
#else
  float acc[R] = {};
  over_runs(w, [&](int64_t k, int64_t j0, int64_t j1) {
    const float s0 = w.scale(w.scales, first + j0), s1 = w.scale(w.scales, first + j1);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = x + r * K + k;
      int32_t half_dot[2] = {0, 0};
      for (int i = 0; i < kRun; ++i) {
        const int32_t wq = Bits == 4 ? (q[k / 2 + i % 16] >> (4 * (i / 16))) & 0x0F
                                     : static_cast<int8_t>(q[k + i]);
        half_dot[i / 16] += wq * xr[i];
      }
      const float d = a.d[(m + r) * a.runs + k / kRun];
      acc[r] += (s0 * float(half_dot[0]) + s1 * float(half_dot[1])) * d;
    }
  });
  for (int r = 0; r < R; ++r) res[r] = acc[r];
  add_mins(w, first, a, m, R, res);
#endif
}

using PassInt8 = void (*)(const QuantRows&, int64_t, const Acts&, int64_t, float*);
constexpr PassInt8 kPassInt8[2][kMaxRows] = {
    {pass_int8<4, 1>, pass_int8<4, 2>, pass_int8<4, 3>, pass_int8<4, 4>},
    {pass_int8<8, 1>, pass_int8<8, 2>, pass_int8<8, 3>, pass_int8<8, 4>}};

template <typename T>
Tensor run_int8(const Tensor& x, const QuantRows& w, int64_t N, const Tensor& bias) {
  const int64_t M = x.size(0);
  const ActsStorage storage = splitserve::quant::quantize_acts(
      reinterpret_cast<const T*>(x.data_ptr()), M, w.K, x.stride(0), w.block_size,
      w.mins != nullptr, kPairOrder, false);
  const Acts acts = storage.view();
  auto out = x.new_empty({M, N});
  const auto* passes = kPassInt8[w.bits == 4 ? 0 : 1];
  over_rows(M, N, bias, reinterpret_cast<T*>(out.data_ptr()),
            [&](int64_t n, int64_t m, int64_t rows, float* res) {
              passes[rows - 1](w, n, acts, m, res);
            });
  return out;
}

// ---- the whole weight in a float dtype ---------------------------------------------------

template <int Bits, typename T>
void dequantize_rows(const QuantRows& w, int64_t N, T* out) {
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      splitserve::quant::dequantize_row<Bits, T>(w, n, out + n * w.K);
  });
}

template <typename T>
void dequantize_as(const QuantRows& w, int64_t N, void* out) {
  (w.bits == 4 ? dequantize_rows<4, T> : dequantize_rows<8, T>)(w, N, static_cast<T*>(out));
}

}  // namespace

namespace splitserve::quant {

std::optional<Tensor> linear_f32(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                                 const std::optional<Tensor>& mins, int64_t bits,
                                 int64_t block_size, const std::optional<Tensor>& bias) {
  const auto w = quant_rows(qweight, scales, mins, bits, block_size);
  if (!w || x.scalar_type() != at::kFloat || !takes_x(x, w->K)) return std::nullopt;
  const int64_t M = x.size(0), N = qweight.size(0), ldx = x.stride(0);
  const auto b = float_bias(bias, N);
  if (!b) return std::nullopt;
  auto out = x.new_empty({M, N});
  const float* xp = x.data_ptr<float>();
  const auto* passes = kPassF32[bits == 4 ? 0 : 1];
  over_rows(M, N, *b, out.data_ptr<float>(), [&](int64_t n, int64_t m, int64_t rows, float* res) {
    passes[rows - 1](*w, n, xp + m * ldx, ldx, res);
  });
  return out;
}

std::optional<Tensor> linear_int8(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                                  const std::optional<Tensor>& mins, int64_t bits,
                                  int64_t block_size, const std::optional<Tensor>& bias) {
  const auto w = quant_rows(qweight, scales, mins, bits, block_size);
  if (!w || !takes_x(x, w->K)) return std::nullopt;
  const int64_t N = qweight.size(0);
  const auto b = float_bias(bias, N);
  if (!b) return std::nullopt;
  if (x.scalar_type() == at::kBFloat16) return run_int8<c10::BFloat16>(x, *w, N, *b);
  if (x.scalar_type() == at::kHalf) return run_int8<c10::Half>(x, *w, N, *b);
  if (x.scalar_type() == at::kFloat) return run_int8<float>(x, *w, N, *b);
  return std::nullopt;
}

bool dequantize_into(Tensor& out, const Tensor& qweight, const Tensor& scales,
                     const std::optional<Tensor>& mins, int64_t bits, int64_t block_size) {
  const auto w = quant_rows(qweight, scales, mins, bits, block_size);
  const int64_t N = qweight.size(0);
  if (!w || !out.device().is_cpu() || !out.is_contiguous() ||
      out.sizes() != at::IntArrayRef{N, w->K})
    return false;
  switch (out.scalar_type()) {
    case at::kFloat: dequantize_as<float>(*w, N, out.data_ptr()); return true;
    case at::kBFloat16: dequantize_as<c10::BFloat16>(*w, N, out.data_ptr()); return true;
    case at::kHalf: dequantize_as<c10::Half>(*w, N, out.data_ptr()); return true;
    default: return false;
  }
}

}  // namespace splitserve::quant
