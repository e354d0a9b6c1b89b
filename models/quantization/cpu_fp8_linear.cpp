// fp8 (e4m3fn) weight-only linear layers on CPU: out = x (scale * W)^T (+ bias) with W
// float8_e4m3fn [N, K] (passed as its bytes) and one float32 scale per output feature.
//
// An e4m3 byte s.eeee.mmm becomes a float16 by moving its bits into place: sign to bit
// 15, exponent and mantissa to bits 13..7 (the top of float16's exponent field stays 0).
// float16's exponent bias is 15, e4m3's 7, so the float16 is the value times 2^-8,
// subnormals included (both formats' subnormals scale alike); vcvtph2ps widens it, and the
// 2^8 goes into the output feature's scale. The NaN byte (0x7F, which no quantizer writes)
// reads as 480 on the vector paths.
//
// `linear` is for the few rows of a decode step: weight rows are converted in pairs, once
// per group of kRowGroup rows of x (they stay in L1 between groups), and multiplied with
// FMA in float32; each weight byte is read from memory once. `dequantize` is for larger
// batches: the weight in the activations' dtype, for a matmul. Paths: AVX-512 (32 bytes a
// step), AVX2 + F16C (16), and a table lookup for the generic build and the tail of K.

#include "torch_ext.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "cpu_api.h"
#include "cpu_math.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int kWeightRows = 2;             // weight rows converted together
constexpr int64_t kBlockBytes = 32 << 10;  // of x (float32) to keep in L1
constexpr float kExponentShift = 256.0f;   // 2^(15 - 7): float16 vs e4m3 exponent bias

// Each byte's value times 2^-8, as the vector paths compute it.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float magnitude = e == 0 ? std::ldexp(float(m), -17) : std::ldexp(8.0f + m, e - 18);
      t[b] = (b & 0x80) ? -magnitude : magnitude;
    }
    return t;
  }();
  return table;
}

#if defined(SPLITSERVE_AVX512)
struct Simd {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  // 2 * kLanes bytes -> their values times 2^-8.
  static void widen(const uint8_t* p, V& lo, V& hi) {
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(int16_t(0xBF80)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
};
#elif defined(SPLITSERVE_AVX2)
struct Simd {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
  }
  static void widen(const uint8_t* p, V& lo, V& hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(int16_t(0xBF80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
};
#endif

// Rows of x multiplied in one pass over the weight rows: as many as leave the
// accumulators (kWeightRows per row) and the converted weights in registers.
#if defined(SPLITSERVE_AVX512)
constexpr int kRowGroup = 8;
#else
constexpr int kRowGroup = 4;
#endif

// dots[j * M + r] += sum_k x[r, k] * w_j[k] * 2^-8 over `len` input features, for the kW
// weight rows w_j (w_stride apart) and the kX rows of x (x_stride apart). One accumulator
// per (j, r): kW * kX independent FMA chains, and each x vector loaded serves kW rows.
template <int kW, int kX>
void dot_tile(const uint8_t* w, int64_t w_stride, const float* x, int64_t x_stride, int64_t len,
              float* dots, int64_t M) {
  int64_t k = 0;
#if defined(SPLITSERVE_AVX2)
  constexpr int64_t kStep = 2 * Simd::kLanes;
  Simd::V acc[kW][kX];
  for (int j = 0; j < kW; ++j)
    for (int r = 0; r < kX; ++r) acc[j][r] = Simd::zero();
  for (; k + kStep <= len; k += kStep) {
    Simd::V lo[kW], hi[kW];
    for (int j = 0; j < kW; ++j) Simd::widen(w + j * w_stride + k, lo[j], hi[j]);
    for (int r = 0; r < kX; ++r) {
      const Simd::V x_lo = Simd::load(x + r * x_stride + k);
      const Simd::V x_hi = Simd::load(x + r * x_stride + k + Simd::kLanes);
      for (int j = 0; j < kW; ++j)
        acc[j][r] = Simd::fma(hi[j], x_hi, Simd::fma(lo[j], x_lo, acc[j][r]));
    }
  }
  for (int j = 0; j < kW; ++j)
    for (int r = 0; r < kX; ++r) dots[j * M + r] += Simd::sum(acc[j][r]);
#endif
  const auto& table = e4m3_table();
  for (; k < len; ++k)
    for (int j = 0; j < kW; ++j)
      for (int r = 0; r < kX; ++r)
        dots[j * M + r] += table[w[j * w_stride + k]] * x[r * x_stride + k];
}

// kW weight rows times the last `rest` (< kRowGroup) rows of x.
template <int kW, int kX = kRowGroup - 1>
void dot_tail(int64_t rest, const uint8_t* w, int64_t w_stride, const float* x, int64_t x_stride,
              int64_t len, float* dots, int64_t M) {
  if constexpr (kX > 0) {
    if (rest == kX)
      dot_tile<kW, kX>(w, w_stride, x, x_stride, len, dots, M);
    else
      dot_tail<kW, kX - 1>(rest, w, w_stride, x, x_stride, len, dots, M);
  }
}

// kW weight rows times all M rows of x, in groups of kRowGroup rows.
template <int kW>
void dot_rows(const uint8_t* w, int64_t w_stride, const float* x, int64_t x_stride, int64_t len,
              float* dots, int64_t M) {
  int64_t m = 0;
  for (; m + kRowGroup <= M; m += kRowGroup)
    dot_tile<kW, kRowGroup>(w, w_stride, x + m * x_stride, x_stride, len, dots + m, M);
  dot_tail<kW>(M - m, w, w_stride, x + m * x_stride, x_stride, len, dots + m, M);
}

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
  const auto& table = e4m3_table();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_fp8", [&] {
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* w = wp + n * w_stride;
        const float s = sp[n] * kExponentShift;
        int64_t k = 0;
#if defined(SPLITSERVE_AVX2)
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
