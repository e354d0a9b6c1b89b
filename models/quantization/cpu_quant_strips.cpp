// Linear layers on a block-quantized weight in strips (models/quantization/strips.py), for
// AVX2 builds and AVX512-BF16 ones without AMX: 8 output features side by side, so that one
// 256-bit register holds the same 4 bytes of 8 rows and every lane accumulates its own
// feature. No horizontal sums, one scale load per half-block for 8 features, and x's values
// are broadcast, not shuffled.
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
// (same Acts, in run order), integer dot products: maddubs on unsigned 4-bit values (4
// chunks' int16 sums cannot overflow), and for 8-bit weights |q| with q's signs moved onto
// x; with VNNI (AVX512-BF16 builds, up to 8 rows a pass, and AVX-VNNI ones, up to 4)
// vpdpbusd sums into int32 directly, and 8-bit weights meet x + 128 as unsigned bytes (Acts
// offset), 128 * sum(q) taken off once per run for every row (no saturation in vpdpbusd,
// unlike maddubs).
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

namespace splitserve::quant {

constexpr int64_t kStrip = 8;  // features per strip

// AVX2 builds, and AVX512-BF16 builds without AMX (their VNNI dot products sum the bytes
// straight into int32, 256 bits wide: as many products a cycle as 512 on Zen 4), compute on
// strips. AVX512F builds keep rows (their pair-order activations), AMX builds too (the
// AMX tiles read rows).
#if defined(SPLITSERVE_AVX2) && !defined(SPLITSERVE_AMX) && \
    (!defined(SPLITSERVE_AVX512) || defined(SPLITSERVE_AVX512_BF16))
#define SPLITSERVE_STRIPS
constexpr bool kStrips = true;
#else
constexpr bool kStrips = false;
#endif
#if defined(SPLITSERVE_AVX512_BF16)
constexpr int64_t kMaxStripRows = 8;  // 32 registers: 8 rows' sums and totals fit
#else
constexpr int64_t kMaxStripRows = 4;  // 16 registers
#endif

struct Strips {
  const uint8_t* q;
  const void* scales;
  const void* mins;
  bool half;
  int64_t N, K, bits, block_size;

  int64_t run_bytes() const { return bits == 4 ? 4 * 32 : 8 * 32; }
  int64_t strip_bytes() const { return K / 32 * run_bytes(); }
  int64_t blocks() const { return K / block_size; }
};

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

// 8 features' scales (or mins) of strip s, block j.
inline __m256 load8(const Strips& w, const void* table, int64_t s, int64_t j) {
  const int64_t at = (s * w.blocks() + j) * kStrip;
  return w.half ? widen8(static_cast<const c10::Half*>(table) + at)
                : widen8(static_cast<const float*>(table) + at);
}

inline __m256i load_chunk(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// ---- x float32 -----------------------------------------------------------------------

// Input i (0..15) of half h of a run, for 8 features, as floats.
template <int Bits>
inline __m256 q_at(const uint8_t* run, int h, int i) {
  const int b = i % 4;
  if constexpr (Bits == 4) {
    const __m256i v = load_chunk(run + 32 * (i / 4));
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srli_epi32(v, 8 * b + 4 * h), _mm256_set1_epi32(0x0F)));
  } else {
    const __m256i v = load_chunk(run + 32 * (4 * h + i / 4));
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24));
  }
}

// Row r's dot products over each half of each run: sum of q * x per feature, then scaled
// (w = s * q + m: s * sum(q x) + m * sum(x), the sums of x over each half in xsums).
template <int Bits, int R>
void strip_pass_f32(const Strips& w, int64_t s, const float* x, int64_t ldx, const float* xsums,
                    float (*res)[kStrip]) {
  constexpr int C = R <= 2 ? 4 : 2;  // independent sums per row, to hide the FMA latency
  __m256 acc[R];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const uint8_t* q = w.q + s * w.strip_bytes();
  const int64_t halves = w.K / 16;
  for (int64_t k = 0; k < w.K; k += kRun) {
    const uint8_t* run = q + k / kRun * w.run_bytes();
    for (int h = 0; h < 2; ++h) {
      __m256 dot[R][C];
      for (auto& row : dot)
        for (auto& v : row) v = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const __m256 qv = q_at<Bits>(run, h, i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          dot[r][i % C] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(x + r * ldx + k + 16 * h + i),
                                          dot[r][i % C]);
      }
      const int64_t j = (k + 16 * h) / w.block_size;
      const __m256 scale = load8(w, w.scales, s, j);
      for (int r = 0; r < R; ++r) {
        __m256 d = dot[r][0];
        for (int c = 1; c < C; ++c) d = _mm256_add_ps(d, dot[r][c]);
        acc[r] = _mm256_fmadd_ps(d, scale, acc[r]);
      }
      if (w.mins != nullptr) {
        const __m256 min = load8(w, w.mins, s, j);
        for (int r = 0; r < R; ++r) {
          const __m256 xsum = _mm256_set1_ps(xsums[r * halves + (k + 16 * h) / 16]);
          acc[r] = _mm256_fmadd_ps(min, xsum, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_store_ps(res[r], acc[r]);
}

using StripPassF32 = void (*)(const Strips&, int64_t, const float*, int64_t, const float*,
                             float (*)[kStrip]);
constexpr int64_t kF32Rows = 4;
constexpr StripPassF32 kStripPassF32[2][kF32Rows] = {
    {strip_pass_f32<4, 1>, strip_pass_f32<4, 2>, strip_pass_f32<4, 3>, strip_pass_f32<4, 4>},
    {strip_pass_f32<8, 1>, strip_pass_f32<8, 2>, strip_pass_f32<8, 3>, strip_pass_f32<8, 4>}};

// ---- int8 activations ---------------------------------------------------------------

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc plus a 4-bit chunk's products: int32 lanes with VNNI, else int16 pairs, which the
// caller widens after the run's 4 chunks (at most 4 * 2 * 15 * 127 per half, twice that
// for both halves: no overflow).
inline __m256i add_q4_chunk(__m256i acc, __m256i u, __m256i a) {
  if constexpr (kVnni) return add_dot4(acc, u, a);
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, a));
}

// Whole: every 32-run lies in one weight block (block sizes that are multiples of 32), so
// both halves of a run share a scale and sum into one accumulator per row. The 8-bit chunk
// loops are unrolled so that a chunk's half (c / 4) is a constant: left a loop, gcc kept
// the sums of blocks of 16 (Q6_K) in an array on the stack (20-65 % slower).
template <int Bits, bool Whole, int R>
void strip_pass_int8(const Strips& w, int64_t s, const Acts& a, int64_t m, float (*res)[kStrip]) {
  constexpr int H = Whole ? 1 : 2;  // accumulators per row
  const int64_t K = w.K;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const uint8_t* q = w.q + s * w.strip_bytes();
  for (int64_t k = 0; k < K; k += kRun) {
    const uint8_t* run = q + k / kRun * w.run_bytes();
    const int64_t j0 = a.half_block[k / 16], j1 = a.half_block[k / 16 + 1];
    __m256i dot[R][H];  // int32 per feature, per half of the run (Whole: both)
    if constexpr (Bits == 4) {
      __m256i sum[R][H];
      for (auto& row : sum)
        for (auto& v : row) v = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load_chunk(run + 32 * c);
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q + (m + r) * K + k + 4 * c;
          sum[r][0] = add_q4_chunk(sum[r][0], lo, bcast4(x));
          sum[r][H - 1] = add_q4_chunk(sum[r][H - 1], hi, bcast4(x + 16));
          for (auto& v : sum[r]) opaque(v);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h)
          dot[r][h] = kVnni ? sum[r][h] : _mm256_madd_epi16(sum[r][h], _mm256_set1_epi16(1));
    } else if constexpr (kVnni) {  // x + 128 (unsigned) times q, less 128 * sum(q)
      __m256i qsum[H];
      for (auto& v : qsum) v = _mm256_setzero_si256();
      for (auto& row : dot)
        for (auto& v : row) v = _mm256_setzero_si256();
      const __m256i ones = _mm256_set1_epi8(1);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i v = load_chunk(run + 32 * c);
        qsum[Whole ? 0 : c / 4] = add_dot4(qsum[Whole ? 0 : c / 4], ones, v);
        for (int r = 0; r < R; ++r) {
          __m256i& d = dot[r][Whole ? 0 : c / 4];
          d = add_dot4(d, bcast4(a.q + (m + r) * K + k + 4 * c), v);
        }
      }
      for (int h = 0; h < H; ++h) {
        const __m256i offset = _mm256_slli_epi32(qsum[h], 7);
        for (int r = 0; r < R; ++r) dot[r][h] = _mm256_sub_epi32(dot[r][h], offset);
      }
    } else {
      for (auto& row : dot)
        for (auto& v : row) v = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i v = load_chunk(run + 32 * c), u = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {  // |q| <= 128, |x| <= 127: no saturation
          const __m256i xs = _mm256_sign_epi8(bcast4(a.q + (m + r) * K + k + 4 * c), v);
          __m256i& d = dot[r][Whole ? 0 : c / 4];
          d = add_dot4(d, u, xs);
          opaque(d);
        }
      }
    }
    const __m256 s0 = load8(w, w.scales, s, j0);
    if constexpr (Whole) {
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(a.d[(m + r) * a.runs + k / kRun]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(s0, d), acc[r]);
      }
    } else {
      const __m256 s1 = j1 == j0 ? s0 : load8(w, w.scales, s, j1);
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(a.d[(m + r) * a.runs + k / kRun]);
        if (j1 == j0) {
          const __m256 both = _mm256_cvtepi32_ps(_mm256_add_epi32(dot[r][0], dot[r][H - 1]));
          acc[r] = _mm256_fmadd_ps(both, _mm256_mul_ps(s0, d), acc[r]);
        } else {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(s0, d), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][H - 1]), _mm256_mul_ps(s1, d), acc[r]);
        }
      }
    }
  }
  if (w.mins != nullptr) {  // plus mins[j] * (sum of the dequantized x over block j)
    const int64_t blocks = w.blocks();
    for (int64_t j = 0; j < blocks; ++j) {
      const __m256 mv = load8(w, w.mins, s, j);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.sums[(m + r) * blocks + j]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_store_ps(res[r], acc[r]);
}

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
                      w.mins != nullptr, false, kVnni && bits == 8);
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
