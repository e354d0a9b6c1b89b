// Numeric helpers shared by the C++ CPU kernels (kernels/build.py puts this folder on
// every kernel's include path), and the check of the ISA the build targets.
//
// kernels/isa.py builds for one ISA and defines SPLITSERVE_<RUNG> for each rung it includes:
// SPLITSERVE_AVX2, SPLITSERVE_AVX512, SPLITSERVE_AVX512_BF16, SPLITSERVE_AMX (x86; or
// SPLITSERVE_AVX2_VNNI on AVX2's side branch) or SPLITSERVE_NEON, SPLITSERVE_NEON_DOTPROD
// (Arm). Kernels choose their paths by these macros only.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if (defined(SPLITSERVE_AVX2) && !(defined(__AVX2__) && defined(__FMA__))) ||          \
    (defined(SPLITSERVE_AVX2_VNNI) && !defined(__AVXVNNI__)) ||                        \
    (defined(SPLITSERVE_AVX512) &&                                                     \
     !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&       \
       defined(__AVX512DQ__))) ||                                                      \
    (defined(SPLITSERVE_AVX512_BF16) &&                                                \
     !(defined(__AVX512BF16__) && defined(__AVX512VNNI__))) ||                         \
    (defined(SPLITSERVE_AMX) && !(defined(__AMX_TILE__) && defined(__AMX_BF16__))) ||  \
    (defined(SPLITSERVE_NEON) && !defined(__ARM_NEON)) ||                              \
    (defined(SPLITSERVE_NEON_DOTPROD) && !defined(__ARM_FEATURE_DOTPROD))
#error "the SPLITSERVE_<ISA> macros need the compiler flags of kernels/isa.py"
#endif

#if defined(SPLITSERVE_AVX2)
#include <immintrin.h>
#endif

#if defined(SPLITSERVE_NEON)
#include <arm_neon.h>
#endif

#if defined(SPLITSERVE_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace splitserve {

// A bfloat16's bits are the top half of a float's.
inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// v kept in a register as it is, opaque to the optimizer from here on: a product rounded
// before this is not fused into a later FMA, and a chain of integer vector adds through v
// is not reassociated into a tree whose terms all live at once (gcc 12 does that to the
// AVX2 strip kernels' int16 sums, and spills the 32 products of a pass to the stack).
template <typename V>
inline void opaque(V& v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

#if defined(SPLITSERVE_AVX2)
// 8 (AVX-512: 16) consecutive bf16 as float32, widened by the same shift.
inline __m256 bf16x8_to_float(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// 8 consecutive float32, bf16 or fp16 values as float32.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::BFloat16* p) {
  return bf16x8_to_float(reinterpret_cast<const uint16_t*>(p));
}
inline __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif
#if defined(SPLITSERVE_AVX512)
inline __m512 bf16x16_to_float(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// exp(y) for y <= 0, Cephes' expf (relative error ~1e-7), 0 below -87 and for -inf.
// Branch-free, so the loops that call it vectorise (std::exp does not without
// -ffast-math).
inline float exp_nonpositive(float y) {
  float yc = y < -87.0f ? -87.0f : y;
  float n = std::floor(yc * 1.44269504088896341f + 0.5f);
  float r = yc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y < -87.0f ? 0.0f : p * scale;
}

#if defined(SPLITSERVE_AVX2)
// exp_nonpositive of 8 lanes (gcc leaves loops of the scalar one unvectorised where they
// also reduce): the same polynomial, the power of two put into the exponent bits.
inline __m256 exp_nonpositive8(__m256 y) {
  const __m256 limit = _mm256_set1_ps(-87.0f);
  const __m256 yc = _mm256_max_ps(y, limit);
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(yc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), yc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 value = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(y, limit, _CMP_LT_OQ), value);
}

// The sum of v's 8 lanes.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(SPLITSERVE_AVX512)
// exp(y) of 16 lanes with y <= 0 (-inf gives 0): exp_nonpositive's polynomial, the power
// of two applied by VSCALEFPS.
inline __m512 exp_nonpositive16(__m512 y) {
  const __m512 yc = _mm512_max_ps(y, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(yc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), yc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __mmask16 tiny = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}
#endif

#if defined(SPLITSERVE_AVX512_BF16)
// Lane j of the result is the pair (a[j], b[j]) of bf16: 16 pairs from two rows of 16.
inline __m512i pair_rows(__m512 a, __m512 b) {
  const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // low half a, high half b
  const __m512i index = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
  return _mm512_permutexvar_epi16(index, pairs);
}
#endif

// g * sigmoid(g), with exp's argument kept <= 0 so that it cannot overflow.
inline float silu(float g) {
  const float e = exp_nonpositive(-std::abs(g));
  return g >= 0 ? g / (1.0f + e) : g * e / (1.0f + e);
}

#if defined(SPLITSERVE_AMX)
// Linux hands out the AMX tile state only to processes that ask for it.
inline bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                     18 /* XFEATURE_XTILEDATA */) == 0;
  return usable;
}

// LDTILECFG's operand: each tile's rows and bytes per row (0 and 0: unused).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// As asm naming the whole struct: gcc 12's _tile_loadconfig tells the compiler it reads
// only the first 8 bytes, which lets it drop stores to the rest (a #GP at LDTILECFG).
inline void load_tile_config(const TileConfig& config) {
  asm volatile("ldtilecfg %0" : : "m"(config));
}
#endif

}  // namespace splitserve
