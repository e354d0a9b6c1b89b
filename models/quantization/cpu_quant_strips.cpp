// Linear layers on a block-quantized weight in strips (models/quantization/strips.py), for
// AVX2 builds, AVX512-BF16 ones without AMX and NEON ones (Arm): 8 output features side by
// side, so that a vector register (two on Arm) holds the same 4 bytes of 8 rows and every
// lane accumulates its own feature. No horizontal sums, one scale load per half-block for 8
// features, and x's values are broadcast, not shuffled.
//
// Strip s (features 8s .. 8s + 7), run r (inputs 32r .. 32r + 31): chunks c of 32 bytes,
// each the c-th 4 bytes of the run of every feature, feature f in dword lane f. bits=4: 4
// chunks, byte b of chunk c holds input 4c + b in its low nibble and 4c + b + 16 in its
// high one (the row layout's bytes, regrouped); bits=8: 8 chunks, input 4c + b.
// scales and mins: [strip][block][feature].
//
// strip_linear_f32: x float32, float32 products: per half-block s * sum(q x) + m * sum(x),
// which is F.linear(x, w.dequantize()) up to float32 rounding. strip_linear_int8: x
// float32/bfloat16/float16, quantized per 32-run as cpu_quant_linear.cpp's linear_int8
// (same Acts, in run order), integer dot products of the weight's bytes and x's (each
// ISA's header says how), scaled per run into float32 sums. Every ISA does the same float
// operations in the same order: its results are bitwise the others'.
// strip_dequantize_into: the weight regrouped into rows, then dequantized as the row kernel
// does (bitwise the same).

#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_quant_linear.h"

// AVX2 builds, and AVX512-BF16 builds without AMX (their VNNI dot products sum the bytes
// straight into int32, 256 bits wide: as many products a cycle as 512 on Zen 4), compute on
// strips (cpu_quant_strips_x86.h), as NEON builds do (cpu_quant_strips_neon.h). AVX512F
// builds keep rows (their pair-order activations), AMX builds too (the AMX tiles read rows).
#if defined(SPLITSERVE_AVX2) && !defined(SPLITSERVE_AMX) && \
    (!defined(SPLITSERVE_AVX512) || defined(SPLITSERVE_AVX512_BF16))
#define SPLITSERVE_STRIPS
#include "cpu_quant_strips_x86.h"
#elif defined(SPLITSERVE_NEON)
#define SPLITSERVE_STRIPS
#include "cpu_quant_strips_neon.h"
#endif

namespace splitserve::quant {

#if defined(SPLITSERVE_STRIPS)
constexpr bool kStrips = true;
#else
constexpr bool kStrips = false;
#endif
#if defined(SPLITSERVE_AVX512_BF16)
constexpr int64_t kMaxStripRows = 8;  // 32 registers: 8 rows' sums and totals fit
#elif defined(SPLITSERVE_NEON)
constexpr int64_t kMaxStripRows = neon::kMaxStripRows;
#else
constexpr int64_t kMaxStripRows = 4;  // 16 registers
#endif
// Whether 8-bit weights meet x + 128 (Acts offset): VNNI's vpdpbusd takes unsigned bytes.
#if defined(SPLITSERVE_AVX2)
constexpr bool kOffsetQ8 = kVnni;
#else
constexpr bool kOffsetQ8 = false;
#endif
#if defined(SPLITSERVE_STRIPS) && defined(SPLITSERVE_AVX2)
using x86::strip_pass_f32;
using x86::strip_pass_int8;
#elif defined(SPLITSERVE_STRIPS)
using neon::strip_pass_f32;
using neon::strip_pass_int8;
#endif

// The strip tensors, as strips.py lays them out (q [N / 8, 8 * row bytes]).
inline std::optional<Strips> strips_of(const at::Tensor& q, const at::Tensor& scales,
                                       const std::optional<at::Tensor>& mins, int64_t bits,
                                       int64_t block_size) {
  const auto q_type = bits == 4 ? at::kByte : at::kChar;
  if (!kStrips || (bits != 4 && bits != 8) || q.scalar_type() != q_type || q.dim() != 2 ||
      !q.device().is_cpu() || !q.is_contiguous() || !scales.is_contiguous() || scales.dim() != 3)
    return std::nullopt;
  const int64_t strips = q.size(0), K = q.size(1) / kStrip * (bits == 4 ? 2 : 1);
  const bool half = scales.scalar_type() == at::kHalf;
  if (q.size(1) % kStrip || block_size <= 0 || block_size % 16 || K % block_size || K % kRun ||
      (!half && scales.scalar_type() != at::kFloat) ||
      scales.sizes() != at::IntArrayRef{strips, K / block_size, kStrip})
    return std::nullopt;
  if (mins.has_value() && (mins->scalar_type() != scales.scalar_type() ||
                           mins->sizes() != scales.sizes() || !mins->is_contiguous()))
    return std::nullopt;
  return Strips{static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr(),
                mins.has_value() ? mins->data_ptr() : nullptr, half, strips * kStrip, K, bits,
                block_size};
}

// Rows 0 .. M - 1 of out [M, N] in passes of up to `most` rows, parallel over strips:
// pass(s, m, rows, res) leaves row r's 8 features in res[r] (float32). Past kBlockedRows
// rows (prefill), each thread runs kRowBlock rows through all of its strips before the next
// kRowBlock: the block's activations stay in L1/L2 while every strip reads them, and
// consecutive strips fill an output row's lines while they are cached. (Strips outermost,
// every strip read all of x and wrote each output line in 32-byte pieces far apart in
// time: 10-25 % more CPU time at 256-2048 rows, SmolLM2's Q4_1 layers, forced AVX2 on
// Emerald Rapids.) Decode batches keep one pass over the weight, which comes from memory.
constexpr int64_t kBlockedRows = 128;
constexpr int64_t kRowBlock = 32;
static_assert(kRowBlock % kMaxStripRows == 0, "passes stay within a block");

template <typename T, typename Pass>
void over_strips(int64_t M, int64_t N, int64_t most, const at::Tensor& bias, T* out,
                 const Pass& pass) {
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t block_rows = M > kBlockedRows ? kRowBlock : M;
  at::parallel_for(0, N / kStrip, 2, [&](int64_t begin, int64_t end) {
    alignas(32) float res[kMaxStripRows][kStrip];
    for (int64_t block = 0; block < M; block += block_rows)
      for (int64_t s = begin; s < end; ++s)
        for (int64_t m = block; m < std::min(M, block + block_rows); m += most) {
          const int64_t rows = std::min(most, M - m);
          pass(s, m, rows, res);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t f = 0; f < kStrip; ++f) {
              const float v = res[r][f] + (b == nullptr ? 0.0f : b[s * kStrip + f]);
              out[(m + r) * N + s * kStrip + f] = static_cast<T>(v);
            }
        }
  });
}

#if defined(SPLITSERVE_STRIPS)
using StripPassF32 = void (*)(const Strips&, int64_t, const float*, int64_t, const float*,
                             float (*)[kStrip]);
constexpr int64_t kF32Rows = 4;
constexpr StripPassF32 kStripPassF32[2][kF32Rows] = {
    {strip_pass_f32<4, 1>, strip_pass_f32<4, 2>, strip_pass_f32<4, 3>, strip_pass_f32<4, 4>},
    {strip_pass_f32<8, 1>, strip_pass_f32<8, 2>, strip_pass_f32<8, 3>, strip_pass_f32<8, 4>}};

using StripPassInt8 = void (*)(const Strips&, int64_t, const Acts&, int64_t, float (*)[kStrip]);
template <int Bits, bool Whole, size_t... R>
constexpr std::array<StripPassInt8, kMaxStripRows> passes_int8(std::index_sequence<R...>) {
  return {strip_pass_int8<Bits, Whole, R + 1>...};
}
template <int Bits, bool Whole>
constexpr std::array<StripPassInt8, kMaxStripRows> kPassesInt8 =
    passes_int8<Bits, Whole>(std::make_index_sequence<kMaxStripRows>());
// [bits 4, 8][whole runs]
constexpr const std::array<StripPassInt8, kMaxStripRows>* kStripPassInt8[2][2] = {
    {&kPassesInt8<4, false>, &kPassesInt8<4, true>},
    {&kPassesInt8<8, false>, &kPassesInt8<8, true>}};

#endif

// The strips and x's bias in float32, when the kernels take x, the weight and the bias.
std::optional<std::pair<Strips, at::Tensor>> strips_and_bias(
    const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
    const std::optional<at::Tensor>& mins, int64_t bits, int64_t block_size,
    const std::optional<at::Tensor>& bias) {
  const auto w = strips_of(q, scales, mins, bits, block_size);
  if (!w || !takes_x(x, w->K)) return std::nullopt;
  const auto b = float_bias(bias, w->N);
  if (!b) return std::nullopt;
  return std::make_pair(*w, *b);
}

std::optional<at::Tensor> strip_linear_f32(const at::Tensor& x, const at::Tensor& q,
                                              const at::Tensor& scales,
                                              const std::optional<at::Tensor>& mins,
                                              int64_t bits, int64_t block_size,
                                              const std::optional<at::Tensor>& bias) {
#if defined(SPLITSERVE_STRIPS)
  const auto wb = strips_and_bias(x, q, scales, mins, bits, block_size, bias);
  if (!wb || x.scalar_type() != at::kFloat) return std::nullopt;
  const Strips& w = wb->first;
  const at::Tensor& b = wb->second;
  const int64_t M = x.size(0), ldx = x.stride(0);
  auto out = x.new_empty({M, w.N});
  const float* xp = x.data_ptr<float>();
  const int64_t halves = w.K / 16;
  std::vector<float> xsums(w.mins == nullptr ? 0 : M * halves);
  for (int64_t i = 0; i < static_cast<int64_t>(xsums.size()); ++i) {
    const float* h = xp + i / halves * ldx + i % halves * 16;
    float sum = 0.0f;
    for (int e = 0; e < 16; ++e) sum += h[e];
    xsums[i] = sum;
  }
  const auto* passes = kStripPassF32[bits == 4 ? 0 : 1];
  over_strips(M, w.N, kF32Rows, b, out.data_ptr<float>(),
              [&](int64_t s, int64_t m, int64_t rows, float (*res)[kStrip]) {
                passes[rows - 1](w, s, xp + m * ldx, ldx, xsums.data() + m * halves, res);
              });
  return out;
#else
  return std::nullopt;
#endif
}

std::optional<at::Tensor> strip_linear_int8(const at::Tensor& x, const at::Tensor& q,
                                               const at::Tensor& scales,
                                               const std::optional<at::Tensor>& mins,
                                               int64_t bits, int64_t block_size,
                                               const std::optional<at::Tensor>& bias) {
#if defined(SPLITSERVE_STRIPS)
  const auto wb = strips_and_bias(x, q, scales, mins, bits, block_size, bias);
  if (!wb) return std::nullopt;
  const Strips& w = wb->first;
  const at::Tensor& b = wb->second;
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const int64_t M = x.size(0);
    const ActsStorage storage =
        quantize_acts(reinterpret_cast<const T*>(x.data_ptr()), M, w.K, x.stride(0), block_size,
                      w.mins != nullptr, false, kOffsetQ8 && bits == 8);
    const Acts acts = storage.view();
    auto out = x.new_empty({M, w.N});
    const auto& passes = *kStripPassInt8[bits == 4 ? 0 : 1][block_size % kRun == 0];
    over_strips(M, w.N, kMaxStripRows, b, reinterpret_cast<T*>(out.data_ptr()),
                [&](int64_t s, int64_t m, int64_t rows, float (*res)[kStrip]) {
                  passes[rows - 1](w, s, acts, m, res);
                });
    return out;
  };
  if (x.scalar_type() == at::kBFloat16) return run(c10::BFloat16());
  if (x.scalar_type() == at::kHalf) return run(c10::Half());
  if (x.scalar_type() == at::kFloat) return run(float());
#endif
  return std::nullopt;
}

// Strip s regrouped into the row layout (quant_rows' QuantRows over `scratch`), its 8
// features as rows 0..7.
inline QuantRows strip_rows(const Strips& w, int64_t s, std::vector<uint8_t>& scratch) {
  const int64_t row_bytes = w.bits == 4 ? w.K / 2 : w.K, blocks = w.blocks();
  const int64_t scale_bytes = w.half ? 2 : 4, table_bytes = kStrip * blocks * scale_bytes;
  scratch.resize(kStrip * row_bytes + 2 * table_bytes);
  uint8_t* q = scratch.data();
  uint8_t* scales = q + kStrip * row_bytes;
  uint8_t* mins = scales + table_bytes;
  const uint8_t* src = w.q + s * w.strip_bytes();
  const int64_t chunks = w.run_bytes() / 32;
  for (int64_t c = 0; c < w.K / kRun * chunks; ++c)  // chunk c of every run, in order
    for (int64_t f = 0; f < kStrip; ++f)
      std::memcpy(q + f * row_bytes + c * 4, src + (c * kStrip + f) * 4, 4);
  const auto regroup = [&](const void* table, uint8_t* out) {
    const auto* t = static_cast<const uint8_t*>(table) + s * table_bytes;
    for (int64_t j = 0; j < blocks; ++j)
      for (int64_t f = 0; f < kStrip; ++f)
        std::memcpy(out + (f * blocks + j) * scale_bytes, t + (j * kStrip + f) * scale_bytes,
                    scale_bytes);
  };
  regroup(w.scales, scales);
  if (w.mins != nullptr) regroup(w.mins, mins);
  return QuantRows{q, scales, w.mins == nullptr ? nullptr : mins, w.half, w.K, w.bits,
                   w.block_size};
}

template <typename T>
void strip_dequantize_as(const Strips& w, T* out) {
  at::parallel_for(0, w.N / kStrip, 4, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch;
    for (int64_t s = begin; s < end; ++s) {
      const QuantRows rows = strip_rows(w, s, scratch);
      for (int64_t f = 0; f < kStrip; ++f)
        (w.bits == 4 ? dequantize_row<4, T> : dequantize_row<8, T>)(
            rows, f, out + (s * kStrip + f) * w.K);
    }
  });
}

bool strip_dequantize_into(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, int64_t bits,
                           int64_t block_size) {
  const auto w = strips_of(q, scales, mins, bits, block_size);
  if (!w || !out.device().is_cpu() || !out.is_contiguous() ||
      out.sizes() != at::IntArrayRef{w->N, w->K})
    return false;
  switch (out.scalar_type()) {
    case at::kFloat: strip_dequantize_as(*w, out.data_ptr<float>()); return true;
    case at::kBFloat16:
      strip_dequantize_as(*w, reinterpret_cast<c10::BFloat16*>(out.data_ptr())); return true;
    case at::kHalf:
      strip_dequantize_as(*w, reinterpret_cast<c10::Half*>(out.data_ptr())); return true;
    default: return false;
  }
}

int64_t strip_width() { return kStrips ? kStrip : 0; }

}  // namespace splitserve::quant
