// The per-ISA pieces of cpu_quant_linear.cpp: reading a BlockQuantWeight's rows
// (models/quantization/block_quant.py) as float32 values or as unsigned bytes for integer
// dot products. A 32-run of a row is 16 bytes for bits=4 (byte i: element i in its low
// nibble, element i + 16 in its high one) and 32 int8 bytes for bits=8; a half is 16 of
// its elements, so every half has one scale (block sizes are multiples of 16). Also the
// per-call quantization of x to int8 (quantize_acts) in the layout these pieces read.
#pragma once

#include <ATen/Parallel.h>
#include "torch_ext.h"
#include <c10/util/Half.h>

#include "cpu_api.h"
#include "cpu_math.h"
#include "cpu_quant_layout.h"
#include "cpu_quantize_run.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace splitserve::quant {

// A contiguous BlockQuantWeight's tensors as the kernels read them.
struct QuantRows {
  const uint8_t* q;
  const void* scales;  // [N, K / block_size], float16 (half) or float32
  const void* mins;    // as scales, or null
  bool half;
  int64_t K, bits, block_size;

  int64_t row_bytes() const { return bits == 4 ? K / 2 : K; }
  int64_t blocks() const { return K / block_size; }
  float scale(const void* table, int64_t i) const {
    if (!half) return static_cast<const float*>(table)[i];
    const uint16_t bits16 = static_cast<const uint16_t*>(table)[i];
#if defined(SPLITSERVE_AVX2)
    return _cvtsh_ss(bits16);
#else
    return static_cast<float>(c10::Half(bits16, c10::Half::from_bits()));
#endif
  }
};

// Calls body(k, j0, j1) for each run k of a row, with the blocks its halves fall in
// (relative to the row's first): a division-free walk over the blocks. Blocks are whole
// halves (multiples of 16), so a run may straddle two blocks (e.g. blocks of 48).
template <typename Body>
inline void over_runs(const QuantRows& w, const Body& body) {
  int64_t j = 0, end = w.block_size;
  for (int64_t k = 0; k < w.K; k += kRun) {
    const int64_t j0 = j;
    if (k + 16 == end) ++j, end += w.block_size;
    const int64_t j1 = j;
    if (k + kRun == end) ++j, end += w.block_size;
    body(k, j0, j1);
  }
}

// The weight's tensors, when they are a contiguous BlockQuantWeight on the CPU.
inline std::optional<QuantRows> quant_rows(const at::Tensor& qweight, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, int64_t bits,
                                    int64_t block_size) {
  const auto q_type = bits == 4 ? at::kByte : at::kChar;
  if ((bits != 4 && bits != 8) || qweight.scalar_type() != q_type || qweight.dim() != 2 ||
      !qweight.device().is_cpu() || !qweight.is_contiguous() || !scales.is_contiguous())
    return std::nullopt;
  const int64_t N = qweight.size(0), K = qweight.size(1) * (bits == 4 ? 2 : 1);
  const bool half = scales.scalar_type() == at::kHalf;
  if (block_size <= 0 || block_size % 16 || K % block_size || K % kRun ||
      (!half && scales.scalar_type() != at::kFloat) ||
      scales.sizes() != at::IntArrayRef{N, K / block_size})
    return std::nullopt;
  if (mins.has_value() && (mins->scalar_type() != scales.scalar_type() ||
                           mins->sizes() != scales.sizes() || !mins->is_contiguous()))
    return std::nullopt;
  return QuantRows{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr(),
                   mins.has_value() ? mins->data_ptr() : nullptr, half, K, bits, block_size};
}

// x's rows as the kernels read them: on the CPU, dense along a row, K features.
inline bool takes_x(const at::Tensor& x, int64_t K) {
  return x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.stride(1) == 1;
}

inline std::optional<at::Tensor> float_bias(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return at::Tensor();
  if (bias->numel() != N) return std::nullopt;
  return bias->to(at::kFloat).contiguous();
}

// `v` as it is: the compiler may not fuse the product it was rounded from into an FMA
// with a later sum (BlockQuantWeight.dequantize rounds the product, then the sum).
template <typename V>
inline V rounded(V v) {
  opaque(v);
  return v;
}

#if defined(SPLITSERVE_AVX512)

// 16 float32 lanes.
struct F16x {
  __m512 v;
};
inline F16x zeros() { return {_mm512_setzero_ps()}; }
// The half h of a 4-bit run, as floats.
inline F16x q4_half(const uint8_t* run, int h) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
  b = _mm_and_si128(h ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F));
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))};
}
inline F16x q8_half(const uint8_t* run, int h) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16 * h));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
// q * s + m, rounded after the product and after the sum as BlockQuantWeight.dequantize.
inline F16x dequant(F16x q, float s, float m) {
  return {_mm512_add_ps(rounded(_mm512_mul_ps(q.v, _mm512_set1_ps(s))), _mm512_set1_ps(m))};
}
inline F16x fma_x(F16x w, const float* x, F16x acc) {
  return {_mm512_fmadd_ps(w.v, _mm512_loadu_ps(x), acc.v)};
}
inline F16x add(F16x a, F16x b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float sum(F16x a) { return _mm512_reduce_add_ps(a.v); }

// Two runs' weights as 64 unsigned bytes in pair order: 16-byte lanes of run 0's first
// half, run 1's first half, run 0's second half, run 1's second half (a 4-bit pair's
// nibbles fall so). 8-bit: the weights themselves, their signs for the activations.
inline __m512i q4_pair(const uint8_t* runs) {
  const __m256i run = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(runs));
  const __m512i both = _mm512_broadcast_i64x4(run);
  const int64_t by4 = 0x0004000400040004;  // the upper 32 bytes shift to their high nibbles
  const __m512i shifts = _mm512_set_epi64(by4, by4, by4, by4, 0, 0, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi8(0x0F));
}
inline __m512i q8_pair(const uint8_t* runs) {
  const __m512i v = _mm512_loadu_si512(runs);
  return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
}
// The weight scales of a pair's 16 lanes (as q4_pair): its halves fall in blocks
// first + hb0 .. first + hb0 + 3; `mask` says which of these to load, `lanes` which of
// them each lane takes.
inline __m512 pair_scales(const QuantRows& w, int64_t first, int32_t hb0, const int32_t* lanes,
                          uint8_t mask) {
  const int64_t j = first + hb0;
  const __m128 s = w.half ? _mm_cvtph_ps(_mm_maskz_loadu_epi16(
                                mask, static_cast<const uint16_t*>(w.scales) + j))
                          : _mm_maskz_loadu_ps(mask, static_cast<const float*>(w.scales) + j);
  return _mm512_permutexvar_ps(_mm512_loadu_si512(lanes), _mm512_castps128_ps512(s));
}

// acc plus table[first + j] * x[j] for j < count, in 16 lanes.
inline __m512 add_dot_scales(const QuantRows& w, const void* table, int64_t first, const float* x,
                             int64_t count, __m512 acc) {
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 mask = count - j >= 16 ? 0xFFFF : (1u << (count - j)) - 1;
    const __m512 s =
        w.half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                     mask, static_cast<const uint16_t*>(table) + first + j))
               : _mm512_maskz_loadu_ps(mask, static_cast<const float*>(table) + first + j);
    acc = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mask, x + j), acc);
  }
  return acc;
}

// 16 int32 lanes, each the dot product of 4 unsigned weights and 4 int8 activations.
inline __m512i dot_pair(__m512i u, __m512i a) {
#if defined(SPLITSERVE_AVX512_BF16)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, a);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, a), _mm512_set1_epi16(1));
#endif
}

#elif defined(SPLITSERVE_AVX2)

struct F16x {
  __m256 lo, hi;
};
inline F16x zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16x bytes_to_floats(__m128i b, bool is_signed) {
  const __m128i b_hi = _mm_srli_si128(b, 8);
  const __m256i lo = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(b_hi) : _mm256_cvtepu8_epi32(b_hi);
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
}
inline F16x q4_half(const uint8_t* run, int h) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
  return bytes_to_floats(_mm_and_si128(h ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F)), false);
}
inline F16x q8_half(const uint8_t* run, int h) {
  return bytes_to_floats(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16 * h)), true);
}
inline F16x dequant(F16x q, float s, float m) {
  const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
  return {_mm256_add_ps(rounded(_mm256_mul_ps(q.lo, vs)), vm),
          _mm256_add_ps(rounded(_mm256_mul_ps(q.hi, vs)), vm)};
}
inline F16x fma_x(F16x w, const float* x, F16x acc) {
  return {_mm256_fmadd_ps(w.lo, _mm256_loadu_ps(x), acc.lo),
          _mm256_fmadd_ps(w.hi, _mm256_loadu_ps(x + 8), acc.hi)};
}
inline F16x add(F16x a, F16x b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline float sum(F16x a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#else  // generic: plain loops the compiler may vectorise

struct F16x {
  float v[16];
};
inline F16x zeros() { return {}; }
inline F16x q4_half(const uint8_t* run, int h) {
  F16x r;
  for (int i = 0; i < 16; ++i) r.v[i] = float((run[i] >> (4 * h)) & 0x0F);
  return r;
}
inline F16x q8_half(const uint8_t* run, int h) {
  F16x r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(static_cast<int8_t>(run[16 * h + i]));
  return r;
}
inline F16x dequant(F16x q, float s, float m) {
  for (float& v : q.v) v = rounded(v * s) + m;
  return q;
}
inline F16x fma_x(F16x w, const float* x, F16x acc) {
  for (int i = 0; i < 16; ++i) acc.v[i] = std::fma(w.v[i], x[i], acc.v[i]);
  return acc;
}
inline F16x add(F16x a, F16x b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline float sum(F16x a) {
  float s = 0.0f;
  for (float v : a.v) s += v;
  return s;
}

#endif

// 16 values as T (float32, BFloat16 or Half), rounded to nearest even.
template <typename T>
inline void store16(T* out, F16x v) {
#if defined(SPLITSERVE_AVX512)
  if constexpr (std::is_same_v<T, float>) return _mm512_storeu_ps(out, v.v);
  if constexpr (std::is_same_v<T, c10::Half>)
    return _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                               _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#if defined(SPLITSERVE_AVX512_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v.v));
#endif
  alignas(64) float f[16];
  _mm512_store_ps(f, v.v);
#elif defined(SPLITSERVE_AVX2)
  alignas(32) float f[16];
  _mm256_store_ps(f, v.lo);
  _mm256_store_ps(f + 8, v.hi);
#else
  const float* f = v.v;
#endif
  for (int i = 0; i < 16; ++i) out[i] = static_cast<T>(f[i]);
}

// Row n of w dequantized into `row` (K values), as BlockQuantWeight.dequantize.
template <int Bits, typename T>
void dequantize_row(const QuantRows& w, int64_t n, T* row) {
  const uint8_t* q = w.q + n * w.row_bytes();
  over_runs(w, [&](int64_t k, int64_t j0, int64_t j1) {
    const uint8_t* run = q + (Bits == 4 ? k / 2 : k);
    for (int h = 0; h < 2; ++h) {
      const int64_t j = n * w.blocks() + (h ? j1 : j0);
      const float m = w.mins == nullptr ? 0.0f : w.scale(w.mins, j);
      store16(row + k + 16 * h,
              dequant(Bits == 4 ? q4_half(run, h) : q8_half(run, h), w.scale(w.scales, j), m));
    }
  });
}

#if defined(SPLITSERVE_AVX2)

// A 32-run's integer dot product with 32 int8 activations, as 8 int32 lanes: lanes 0-3
// cover the run's first half, lanes 4-7 its second. `u` holds the weights as unsigned
// bytes: 4-bit values, or |q| for 8-bit ones, whose signs then move onto the activations.
inline __m256i q4_run(const uint8_t* run) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}
// Whether add_dot4 is one vpdpbusd, which sums into int32 without saturating: AVX512-BF16
// builds (every CPU with AVX512-BF16 has AVX512-VNNI) and AVX-VNNI ones.
#if defined(SPLITSERVE_AVX512_BF16) || defined(SPLITSERVE_AVX2_VNNI)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
// acc plus those 4-byte dot products of unsigned u and signed a, per int32 lane.
inline __m256i add_dot4(__m256i acc, __m256i u, __m256i a) {
#if defined(SPLITSERVE_AVX512_BF16)
  return _mm256_dpbusd_epi32(acc, u, a);
#elif defined(SPLITSERVE_AVX2_VNNI)  // the same instruction, VEX-encoded
  return _mm256_dpbusd_avx_epi32(acc, u, a);
#else  // |u| <= 128 and |a| <= 127: the int16 pair sums cannot saturate
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}
inline float sum8(__m256 s) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#endif

struct ActsStorage {
  std::vector<int8_t> q;
  std::vector<float> d, dv, sums;
  std::vector<int32_t> half_block, scale_lanes;
  std::vector<uint8_t> scale_masks;
  int64_t runs = 0, pairs = 0;

  Acts view() const {
    return {q.data(),          d.data(),           dv.data(),          sums.data(),
            half_block.data(), scale_lanes.data(), scale_masks.data(), runs,
            pairs};
  }
};

template <typename T>
ActsStorage quantize_acts(const T* x, int64_t M, int64_t K, int64_t ldx, int64_t block_size,
                          bool with_sums, bool pair_order, bool offset) {
  ActsStorage a;
  a.runs = K / kRun;
  a.pairs = pair_order ? K / (2 * kRun) : 0;
  const int64_t blocks = K / block_size;
  a.q.resize(M * K);
  a.d.resize(M * a.runs);
  a.dv.resize(M * a.pairs * 16);
  a.sums.resize(with_sums ? M * blocks : 0);
  for (int64_t k = 0; k < K; k += 16) a.half_block.push_back(static_cast<int32_t>(k / block_size));
  for (int64_t p = 0; p < a.pairs; ++p) {  // lanes: run 0's first half, run 1's, then seconds
    const int32_t* hb = a.half_block.data() + 4 * p;
    for (int half : {0, 2, 1, 3})
      for (int i = 0; i < 4; ++i) a.scale_lanes.push_back(hb[half] - hb[0]);
    a.scale_masks.push_back(static_cast<uint8_t>((2u << (hb[3] - hb[0])) - 1));
  }
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = a.q.data() + m * K;
      float* d = a.d.data() + m * a.runs;
      for (int64_t k = 0; k < K; k += kRun) d[k / kRun] = quantize_run(x + m * ldx + k, q + k);
      for (int64_t j = 0; with_sums && j < blocks; ++j) {
        float s = 0.0f;
        for (int64_t k = j * block_size; k < (j + 1) * block_size; k += 16) {
          int32_t t = 0;
          for (int64_t i = 0; i < 16; ++i) t += q[k + i];
          s += d[k / kRun] * static_cast<float>(t);
        }
        a.sums[m * blocks + j] = s;
      }
      for (int64_t p = 0; p < a.pairs; ++p) {  // run 0's second half <-> run 1's first
        std::swap_ranges(q + 64 * p + 16, q + 64 * p + 32, q + 64 * p + 32);
        for (int64_t i = 0; i < 16; ++i) a.dv[(m * a.pairs + p) * 16 + i] = d[2 * p + (i / 4) % 2];
      }
      for (int64_t i = 0; offset && i < K; ++i) q[i] = static_cast<int8_t>(q[i] ^ 0x80);
    }
  });
  return a;
}

}  // namespace splitserve::quant
