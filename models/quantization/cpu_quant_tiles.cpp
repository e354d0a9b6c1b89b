// linear_bf16: x bfloat16 of a few to a few hundred rows times a block-quantized weight,
// on the bf16 dot-product instructions, the weight's bytes read once per call.
//
// The weight is walked in strips of 16 output features. Each strip is dequantized in
// registers, as BlockQuantWeight.dequantize computes it, rounded to bf16 (as
// dequantize(torch.bfloat16)) into a per-thread buffer of K / 32 tiles [16 features][32
// inputs]; then every row of x meets it there, in the cache. Products accumulate in
// float32 and round to bf16 once, after the bias.
//
// With AMX the strip's tile is the A operand and x the B one: out^T = W x^T, so the
// weight needs no VNNI reshuffle, only x, once per call ([K / 2][rows padded to 16] pairs
// of features). C tiles 0-3 hold four 16 x 16 blocks (features x rows of x), tile 4 the
// weight, tiles 5-7 x. Without AMX (or where the process may not use it), vdpbf16ps on
// each feature's runs against each row of x.

#include "torch_ext.h"
#include <ATen/Parallel.h>

#include "cpu_quant_linear.h"

namespace splitserve::quant {

#if defined(SPLITSERVE_AVX512_BF16)
namespace {

constexpr int64_t kTile = 16;              // output features per strip, rows of x per C tile
constexpr int64_t kTileElems = 16 * kRun;  // bf16 values of one strip tile

// The 32 bf16 values a 4-bit run's halves can take: q * s0 + m0 for q < 16 in words
// 0-15, q * s1 + m1 in words 16-31 (rounded as dequant rounds).
inline __m512i q4_table(const QuantRows& w, int64_t j0, int64_t j1) {
  const F16x levels = {_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)};
  const auto values = [&](int64_t j) {
    return dequant(levels, w.scale(w.scales, j), w.mins == nullptr ? 0.0f : w.scale(w.mins, j)).v;
  };
  const __m512 low = values(j0);
  return (__m512i)_mm512_cvtne2ps_pbh(j1 == j0 ? low : values(j1), low);
}

// The strip of features n0 .. n0 + 15 as bf16 tiles [K / 32][16][32]. A 4-bit run is 32
// lookups in its halves' table (q4_table), its high half's nibbles offset by 16.
template <int Bits>
void dequantize_strip(const QuantRows& rows, int64_t n0, uint16_t* strip) {
  const QuantRows w = rows;  // a local copy: the stores below cannot change it
  const __m512i high_half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  for (int64_t r = 0; r < kTile; ++r) {
    const int64_t n = n0 + r, first = n * w.blocks();
    const uint8_t* q = w.q + n * w.row_bytes();
    over_runs(w, [&](int64_t k, int64_t j0, int64_t j1) {
      __m512i values;
      if constexpr (Bits == 4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
        const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                                                 _mm256_set1_epi8(0x0F));
        const __m512i index = _mm512_or_si512(_mm512_cvtepu8_epi16(nibbles), high_half);
        values = _mm512_permutexvar_epi16(index, q4_table(w, first + j0, first + j1));
      } else {
        F16x half[2];
        for (int h = 0; h < 2; ++h) {
          const int64_t j = first + (h ? j1 : j0);
          const float m = w.mins == nullptr ? 0.0f : w.scale(w.mins, j);
          half[h] = dequant(q8_half(q + k, h), w.scale(w.scales, j), m);
        }
        values = (__m512i)_mm512_cvtne2ps_pbh(half[1].v, half[0].v);
      }
      _mm512_storeu_si512(strip + k / kRun * kTileElems + r * kRun, values);
    });
  }
}

// out[m, n0 + i] = bf16(acc[i] + bias[n0 + i]) for the strip's 16 features.
inline void store_features(__m512 acc, const float* bias, int64_t n0, uint16_t* out) {
  if (bias != nullptr) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + n0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n0), (__m256i)_mm512_cvtneps_pbh(acc));
}

// The strip times every row of x, with vdpbf16ps.
void strip_dot(const uint16_t* strip, const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
               int64_t N, const float* bias, int64_t n0, uint16_t* out) {
  alignas(64) float res[kTile];
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xm = x + m * ldx;
    for (int64_t r = 0; r < kTile; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kRun)
        acc = _mm512_dpbf16_ps(
            acc, (__m512bh)_mm512_loadu_si512(strip + (k / kRun) * kTileElems + r * kRun),
            (__m512bh)_mm512_loadu_si512(xm + k));
      res[r] = _mm512_reduce_add_ps(acc);
    }
    store_features(_mm512_load_ps(res), bias, n0, out + m * N);
  }
}

#if defined(SPLITSERVE_AMX)

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  load_tile_config(config);
}

// C tiles 0 .. Tiles - 1: the strip times x's rows m0 .. m0 + 16 Tiles - 1 (pairs xv, a
// row of them `ld` rows of x long), stored as [Tiles][16 features][16 rows] into c.
template <int Tiles>
void strip_tiles(const uint16_t* strip, const uint32_t* xv, int64_t ld, int64_t k_tiles,
                 float* c) {
  _tile_zero(0);
  if constexpr (Tiles > 1) _tile_zero(1);
  if constexpr (Tiles > 2) _tile_zero(2);
  if constexpr (Tiles > 3) _tile_zero(3);
  const int64_t stride = ld * 4;
  for (int64_t kb = 0; kb < k_tiles; ++kb) {
    const uint32_t* b = xv + kb * 16 * ld;
    _tile_loadd(4, strip + kb * kTileElems, 64);
    _tile_loadd(5, b, stride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (Tiles > 1) {
      _tile_loadd(6, b + 16, stride);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (Tiles > 2) {
      _tile_loadd(7, b + 32, stride);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (Tiles > 3) {
      _tile_loadd(5, b + 48, stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (Tiles > 1) _tile_stored(1, c + 256, 64);
  if constexpr (Tiles > 2) _tile_stored(2, c + 512, 64);
  if constexpr (Tiles > 3) _tile_stored(3, c + 768, 64);
}

using StripTiles = void (*)(const uint16_t*, const uint32_t*, int64_t, int64_t, float*);
constexpr StripTiles kStripTiles[4] = {strip_tiles<1>, strip_tiles<2>, strip_tiles<3>,
                                       strip_tiles<4>};

// x's rows as feature pairs [K / 2][ld], rows from M to ld zero.
std::vector<uint32_t> pack_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t ld) {
  std::vector<uint32_t> xv(K / 2 * ld, 0);
  for (int64_t m = 0; m < M; ++m) {
    const auto* row = reinterpret_cast<const uint32_t*>(x + m * ldx);
    for (int64_t p = 0; p < K / 2; ++p) xv[p * ld + m] = row[p];
  }
  return xv;
}

// The strip times every row of x, with the tiles (configured).
void strip_amx(const uint16_t* strip, const uint32_t* xv, int64_t ld, int64_t M, int64_t K,
               int64_t N, const float* bias, int64_t n0, uint16_t* out) {
  alignas(64) float c[4 * kTile * kTile];
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(kTile),
                                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0));
  for (int64_t m0 = 0; m0 < M; m0 += 4 * kTile) {
    const int64_t tiles = std::min<int64_t>(4, (M - m0 + kTile - 1) / kTile);
    kStripTiles[tiles - 1](strip, xv + m0, ld, K / kRun, c);
    for (int64_t m = m0; m < std::min(M, m0 + 4 * kTile); ++m) {
      const int64_t i = m - m0, t = i / kTile;
      const __m512 acc = _mm512_i32gather_ps(column, c + t * kTile * kTile + i % kTile, 4);
      store_features(acc, bias, n0, out + m * N);
    }
  }
}

#endif

}  // namespace
#endif

std::optional<at::Tensor> linear_bf16(const at::Tensor& x, const at::Tensor& qweight,
                                         const at::Tensor& scales,
                                         const std::optional<at::Tensor>& mins, int64_t bits,
                                         int64_t block_size,
                                         const std::optional<at::Tensor>& bias) {
#if defined(SPLITSERVE_AVX512_BF16)
  const auto w = quant_rows(qweight, scales, mins, bits, block_size);
  const int64_t N = qweight.size(0);
  if (!w || x.scalar_type() != at::kBFloat16 || !takes_x(x, w->K) || N % kTile)
    return std::nullopt;
  const auto b = float_bias(bias, N);
  if (!b) return std::nullopt;
  const int64_t M = x.size(0), K = w->K, ldx = x.stride(0);
  auto out = x.new_empty({M, N});
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* bp = b->defined() ? b->data_ptr<float>() : nullptr;
  const auto dequantize = w->bits == 4 ? dequantize_strip<4> : dequantize_strip<8>;
#if defined(SPLITSERVE_AMX)
  const bool tiles = amx_usable();
  const int64_t ld = (M + kTile - 1) / kTile * kTile;
  const std::vector<uint32_t> xv = tiles ? pack_x(xp, ldx, M, K, ld) : std::vector<uint32_t>();
#endif
  at::parallel_for(0, N / kTile, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> strip(kTile * K);
#if defined(SPLITSERVE_AMX)
    if (tiles) configure_tiles();
#endif
    for (int64_t s = begin; s < end; ++s) {
      dequantize(*w, s * kTile, strip.data());
#if defined(SPLITSERVE_AMX)
      if (tiles) {
        strip_amx(strip.data(), xv.data(), ld, M, K, N, bp, s * kTile, op);
        continue;
      }
#endif
      strip_dot(strip.data(), xp, ldx, M, K, N, bp, s * kTile, op);
    }
#if defined(SPLITSERVE_AMX)
    if (tiles) _tile_release();
#endif
  });
  return out;
#else
  return std::nullopt;
#endif
}

}  // namespace splitserve::quant
