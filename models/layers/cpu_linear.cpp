// Small-batch bf16 linear layers with AMX: out = x W^T (+ bias) for the few rows a decode
// step has. There the weights' bytes are the cost, and the general matmul reads them at
// about a third of the memory bandwidth; this kernel streams each weight once, from a copy
// packed for the tile instructions (pack_weight). It reads x once per 32 output features,
// so it is for x that stays in the cache (cpu_linear.py's SMALL_BATCH_ROWS).
//
// Packed layout, per tile of 16 output features x 32 input features: 16 rows of input
// feature pairs, each row 16 features x 2 bf16 (VNNI), i.e. [N/16][K/32][16][16][2]; so
// the 1 KB tile the product needs is one contiguous load, and one output block's tiles
// follow each other along K. A program owns two output blocks (32 features) and walks x
// in chunks of 32 rows: C tiles tmm0-3 (the chunk's rows 0-15 and 16-31, two blocks
// each), x tiles tmm4-5, weight tiles tmm6-7.
// Accumulation is float32; results round to bf16 once, after the bias, as F.linear's.
//
// pack_weight and linear say which tensors they take: they return None, doing nothing, for
// the others (the layer then runs F.linear).

#include "torch_ext.h"
#include <ATen/Parallel.h>

#include "cpu_api.h"
#include "cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

#if defined(SPLITSERVE_AMX)

// A bf16 CPU matrix whose rows are dense.
bool bf16_rows(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 && t.device().is_cpu() && t.dim() == 2 &&
         t.stride(1) == 1;
}

constexpr int64_t kTileN = 16;  // output features per weight tile
constexpr int64_t kTileK = 32;  // input features per weight tile
constexpr int64_t kChunkRows = 32;  // rows of x the C tiles hold: two blocks of 16

// The first chunk of rows streams a pair's weight tiles from memory, each block's
// kAheadTiles ahead of its k prefetched (into L2): the hardware prefetchers stop at every
// 4 KB page. SmolLM2's 120 bf16 layer weights on 2 Emerald Rapids cores, one process,
// alternated: 1 row 16.5 -> 11.0 ms, 32 rows 22.6 -> 15.5, 64 rows 17.2 -> 13.9, 128 rows
// 25.6 -> 21.0 (1-3 tiles ahead alike, 8 and more worse; prefetching the next pair from
// the later chunks' passes no better).
constexpr int64_t kAheadTiles = 2;

inline void prefetch_tile(const uint16_t* tile) {
  const char* bytes = reinterpret_cast<const char*>(tile);
  for (int64_t line = 0; line < kTileK * kTileN * 2; line += 64)
    __builtin_prefetch(bytes + line, 0, 2);
}

using splitserve::load_tile_config;
using splitserve::TileConfig;

// One 16 x 16 float32 tile (rows of `tile`) plus the bias, as bf16 into `rows` rows of out.
inline void store_rows(const float* tile, int64_t rows, const float* bias, uint16_t* out,
                       int64_t out_stride) {
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(tile + r * kTileN), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride),
                        (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// The tile shapes of a chunk of `rows0` + `rows1` rows of x (rows1 0: tiles 2, 3 and 5
// stay unconfigured, as an unused tile must).
void configure_tiles(int64_t rows0, int64_t rows1) {
  TileConfig config;
  for (int t : {0, 1, 4, 6, 7}) config.colsb[t] = 64;
  config.rows[0] = config.rows[1] = config.rows[4] = static_cast<uint8_t>(rows0);
  config.rows[6] = config.rows[7] = kTileK / 2;
  if (rows1 > 0) {
    for (int t : {2, 3, 5}) {
      config.colsb[t] = 64;
      config.rows[t] = static_cast<uint8_t>(rows1);
    }
  }
  load_tile_config(config);
}

#endif

}  // namespace

namespace splitserve::amx_linear {

#if defined(SPLITSERVE_AMX)

bool amx_usable() { return splitserve::amx_usable(); }

// The weight [out_features, in_features] in the tile layout; None unless it is bf16 on the
// CPU with both sizes multiples of 32.
std::optional<at::Tensor> pack_weight(const at::Tensor& weight) {
  if (weight.scalar_type() != at::kBFloat16 || !weight.device().is_cpu() || weight.dim() != 2)
    return std::nullopt;
  const int64_t N = weight.size(0), K = weight.size(1);
  if (N % (2 * kTileN) != 0 || K % kTileK != 0) return std::nullopt;
  const auto w = weight.contiguous();
  auto packed = w.new_empty({N / kTileN, K / kTileK, kTileK / 2, kTileN, 2});
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t num_k_tiles = K / kTileK;
  at::parallel_for(0, N / kTileN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      uint16_t* out = dst + nb * num_k_tiles * kTileK * kTileN;
      for (int64_t kb = 0; kb < num_k_tiles; ++kb)
        for (int64_t p = 0; p < kTileK / 2; ++p)
          for (int64_t n = 0; n < kTileN; ++n)
            for (int64_t j = 0; j < 2; ++j)
              *out++ = src[(nb * kTileN + n) * K + kb * kTileK + 2 * p + j];
    }
  });
  return packed;
}

// x [rows, in_features] W^T (+ bias); None unless x is bf16 rows (dense) on the CPU.
std::optional<at::Tensor> linear(const at::Tensor& x, const at::Tensor& packed,
                                    const std::optional<at::Tensor>& bias) {
  if (!bf16_rows(x)) return std::nullopt;
  TORCH_CHECK(amx_usable(), "AMX tiles are not available to this process");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 &&
                  packed.is_contiguous(),
              "packed must come from pack_weight");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t num_n_tiles = packed.size(0), num_k_tiles = packed.size(1);
  const int64_t N = num_n_tiles * kTileN;
  TORCH_CHECK(K == num_k_tiles * kTileK, "x has ", K, " features, the weight ",
              num_k_tiles * kTileK);
  at::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " values");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  auto out = x.new_empty({M, N});
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t x_stride = x.stride(0);
  const int64_t tile_elems = kTileK * kTileN;
  at::parallel_for(0, num_n_tiles / 2, 1, [&](int64_t begin, int64_t end) {
    int64_t configured = -1;  // rows of the chunk the tiles are shaped for
    alignas(64) float tile[16 * kTileN];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t nb = 2 * pair;
      const uint16_t* w0 = wp + nb * num_k_tiles * tile_elems;
      const uint16_t* w1 = w0 + num_k_tiles * tile_elems;
      const float* b0 = b == nullptr ? nullptr : b + nb * kTileN;
      const float* b1 = b == nullptr ? nullptr : b0 + kTileN;
      // Rows in chunks of kChunkRows: the pair's weight tiles come from memory for the
      // first chunk and from the cache for the others.
      for (int64_t m = 0; m < M; m += kChunkRows) {
        const int64_t rows = std::min(kChunkRows, M - m);
        const int64_t rows0 = std::min<int64_t>(rows, 16), rows1 = rows - rows0;
        if (rows != configured) {
          configure_tiles(rows0, rows1);
          configured = rows;
        }
        const uint16_t* x0 = xp + m * x_stride;
        _tile_zero(0);
        _tile_zero(1);
        if (rows1 > 0) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t kb = 0; kb < num_k_tiles; ++kb) {
          if (m == 0) {
            prefetch_tile(w0 + (kb + kAheadTiles) * tile_elems);
            prefetch_tile(w1 + (kb + kAheadTiles) * tile_elems);
          }
          _tile_loadd(4, x0 + kb * kTileK, x_stride * 2);
          _tile_loadd(6, w0 + kb * tile_elems, 64);
          _tile_loadd(7, w1 + kb * tile_elems, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (rows1 > 0) {
            _tile_loadd(5, x0 + 16 * x_stride + kb * kTileK, x_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        uint16_t* o = op + m * N + nb * kTileN;
        _tile_stored(0, tile, 64);
        store_rows(tile, rows0, b0, o, N);
        _tile_stored(1, tile, 64);
        store_rows(tile, rows0, b1, o + kTileN, N);
        if (rows1 > 0) {
          _tile_stored(2, tile, 64);
          store_rows(tile, rows1, b0, o + 16 * N, N);
          _tile_stored(3, tile, 64);
          store_rows(tile, rows1, b1, o + 16 * N + kTileN, N);
        }
      }
    }
    _tile_release();
  });
  return out;
}

#endif  // SPLITSERVE_AMX: only AMX builds compile this file (kernels/libraries.py)

}  // namespace splitserve::amx_linear
