// fp8 KV pages in the CPU kernels (part of cpu_attn_common.h).
//
// A page value is read through fp16: an e5m2 byte is the high byte of the fp16 of the same
// value; an e4m3 byte with its sign moved to bit 15 and its exponent and mantissa shifted
// left by 7 is the fp16 of 2^-8 times its value (subnormals included: both formats scale
// their subnormals alike). kPageUnit<C> is that power of two, folded with the layer's scale
// into the q scale (K) and the output (V), so the widening is a shift and a vcvtph2ps.
// Stores round x / scale, clamped to the finite range, to nearest even (c10's conversion,
// as torch's .to() does).
#pragma once

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

namespace {

using E4M3 = at::Float8_e4m3fn;
using E5M2 = at::Float8_e5m2;

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, E4M3> || std::is_same_v<C, E5M2>;

template <typename C>
constexpr float kPageUnit = std::is_same_v<C, E4M3> ? 256.0f : 1.0f;

inline uint16_t fp16_bits(E4M3 x) {
  return uint16_t(((x.x & 0x80) << 8) | ((x.x & 0x7F) << 7));
}
inline uint16_t fp16_bits(E5M2 x) { return uint16_t(x.x << 8); }

inline float fp16_to_float(uint16_t bits) {
#if defined(SPLITSERVE_AVX2)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// A page element as float, divided by kPageUnit<C> (1 for 16/32-bit pages).
template <typename C>
inline float page_value(C x) {
  if constexpr (kIsFp8<C>)
    return fp16_to_float(fp16_bits(x));
  else
    return to_float(x);
}

template <typename C>
inline C quantize(float x, float scale) {
  constexpr float limit = std::is_same_v<C, E4M3> ? 448.0f : 57344.0f;
  return C(std::min(std::max(x / scale, -limit), limit));
}

// Token t's K and V rows, quantized, into the fp8 cache at slots[t] (t < n; -1 skipped).
template <typename T, typename C>
void store_fp8(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
               const int64_t* slots, int64_t n, double k_scale, double v_scale) {
  const int64_t row = k.size(1) * k.size(2);
  C* key_cache = kv_cache.data_ptr<C>();
  C* value_cache = key_cache + kv_cache.stride(0);
  const T* key = k.data_ptr<T>();
  const T* value = v.data_ptr<T>();
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  const float ks = float(k_scale), vs = float(v_scale);
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      C* kd = key_cache + slots[t] * row;
      C* vd = value_cache + slots[t] * row;
      for (int64_t i = 0; i < row; ++i) {
        kd[i] = quantize<C>(to_float(key[t * k_stride + i]), ks);
        vd[i] = quantize<C>(to_float(value[t * v_stride + i]), vs);
      }
    }
  });
}

#if defined(SPLITSERVE_AVX2)
// Eight page bytes as their fp16 bit patterns (see above).
template <typename C>
inline __m128i fp16_bits8(const C* p) {
  __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (std::is_same_v<C, E4M3>)
    return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                        _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
  else
    return _mm_slli_epi16(w, 8);
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(SPLITSERVE_AVX512)
template <typename C>
inline __m512 widen16(const C* p) {
  __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (std::is_same_v<C, E4M3>)
    w = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
  else
    w = _mm256_slli_epi16(w, 8);
  return _mm512_cvtph_ps(w);
}
#endif

// q . k over D (a multiple of 16) fp8 values, k in page units.
template <typename C, int D>
inline float dot_fp8(const float* q, const C* k) {
#if defined(SPLITSERVE_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), widen16(k + d), acc);
  return _mm512_reduce_add_ps(acc);
#elif defined(SPLITSERVE_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_cvtph_ps(fp16_bits8(k + d)), acc);
  return sum8(acc);
#else
  float acc = 0.0f;
  for (int d = 0; d < D; ++d) acc += q[d] * page_value(k[d]);
  return acc;
#endif
}

// acc += p * v over D (a multiple of 16) fp8 values, v in page units.
template <typename C, int D>
inline void axpy_fp8(float* acc, float p, const C* v) {
#if defined(SPLITSERVE_AVX512)
  const __m512 w = _mm512_set1_ps(p);
  for (int d = 0; d < D; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(w, widen16(v + d), _mm512_loadu_ps(acc + d)));
#elif defined(SPLITSERVE_AVX2)
  const __m256 w = _mm256_set1_ps(p);
  for (int d = 0; d < D; d += 8) {
    const __m256 x = _mm256_cvtph_ps(fp16_bits8(v + d));
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, x, _mm256_loadu_ps(acc + d)));
  }
#else
  for (int d = 0; d < D; ++d) acc[d] += p * page_value(v[d]);
#endif
}

#if defined(SPLITSERVE_AVX512_BF16)
// The bf16 bits of m * 2^(1 - bias - mantissa bits), the value of subnormal code m.
template <typename C>
inline __m512i subnormal_bf16_table() {
  static const std::array<uint16_t, 32> table = [] {
    constexpr int mant = std::is_same_v<C, E4M3> ? 3 : 2, bias = std::is_same_v<C, E4M3> ? 7 : 15;
    std::array<uint16_t, 32> bits{};
    for (int m = 0; m < (1 << mant); ++m) {
      const float value = std::ldexp(float(m), 1 - bias - mant);
      uint32_t word;
      std::memcpy(&word, &value, sizeof word);
      bits[m] = uint16_t(word >> 16);
    }
    return bits;
  }();
  return _mm512_loadu_si512(table.data());
}

// 32 fp8 values as bf16 bits (exact): the exponent rebiased and the mantissa moved into
// place with integer ops, the subnormal codes (exponent 0) looked up.
template <typename C>
inline __m512i widen32_bf16(const C* p) {
  constexpr int mant = std::is_same_v<C, E4M3> ? 3 : 2, bias = std::is_same_v<C, E4M3> ? 7 : 15;
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i magnitude = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 7 - mant),
                                          _mm512_set1_epi16(int16_t((127 - bias) << 7)));
  const __mmask32 subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(1 << mant));
  const __m512i value =
      _mm512_mask_permutexvar_epi16(normal, subnormal, magnitude, subnormal_bf16_table<C>());
  return _mm512_or_si512(value, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

// fp8 pages with bf16 queries take the bf16 decode paths (AMX, AVX2) over a copy
// of the item's context widened to bf16 (exact): positions first .. seq_len - 1 of KV heads
// kv_head .. kv_head + heads - 1 as a cache of one block (16-position aligned, zero past
// the context) whose rows hold those heads; the scales go to the q scale and the output.
// `context` gets the layout of that copy.
template <typename C, int D>
void widen_context(const C* cache, const int32_t* blocks, int64_t first, int64_t seq_len,
                   int64_t kv_head, int64_t heads, const Layout& L, std::vector<uint16_t>& buffer,
                   Layout& context) {
  const int64_t n = seq_len - first, padded = (n + 15) / 16 * 16, row = heads * D;
  buffer.resize(2 * padded * row);
  context = L;
  context.block_size = padded;
  context.kv_heads = heads;
  context.cache_half = padded * row;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = first + i;
    const C* k = cache + (blocks[pos / L.block_size] * L.block_size + pos % L.block_size) *
                             L.kv_heads * D + kv_head * D;
    uint16_t* kd = buffer.data() + i * row;
    for (int64_t d = 0; d < row; d += 32) {
      _mm512_storeu_si512(kd + d, widen32_bf16(k + d));
      _mm512_storeu_si512(kd + context.cache_half + d, widen32_bf16(k + L.cache_half + d));
    }
  }
  for (int64_t half = 0; half < 2; ++half) {
    uint16_t* tail = buffer.data() + half * context.cache_half;
    std::fill(tail + n * row, tail + padded * row, uint16_t{0});
  }
}
#endif

}  // namespace
