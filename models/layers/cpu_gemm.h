// The GEMM of cpu_dense_linear.cpp (included there, inside its namespace, after Vec and
// widen): out = x W^T (+ bias) for many rows, float32 math, W float32 or bf16 [N, K].
//
// W is packed a group of features at a time into panels of kGemmCols features,
// [K][kGemmCols] each (bf16 widened on the way), zero past N. A tile is Vec::kGemmTileRows
// rows x kGemmCols features, 2 vectors of accumulators a row: per k, the panel's two
// vectors and one broadcast x value a row (x as it is, rows K apart). AVX-512F tiles of 14
// rows (28 accumulators of 32 registers), AVX2 6 (12 of 16). The work items are (panel,
// row tile) pairs, panel by panel: a thread reuses its panel from L1/L2 across row tiles
// while x streams from L3. On 2 Zen 4 cores, SmolLM2's four layer shapes at 2048 rows
// (qkv, o, gate_up, down), x and W in cache: 184-197 GFLOP/s with the packing, where
// torch's float32 GEMM ran at 134-167 in the same runs (peak 228); packing x as well
// measured slower. The compare_cpu float32 workload's prefill steps: 25 % less time.
#pragma once

constexpr int64_t kGemmCols = 2 * Vec::kLanes;
constexpr int64_t kGemmPackBytes = 8 << 20;  // the panels packed at a time

// tile[r][c] = x row r . panel feature c, for kGemmTileRows rows K apart.
__attribute__((noinline)) void gemm_tile(const float* x, int64_t K, const float* panel,
                                         float* tile) {
  constexpr int R = Vec::kGemmTileRows;
  Vec acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    const Vec b0 = Vec::load(panel + k * kGemmCols);
    const Vec b1 = Vec::load(panel + k * kGemmCols + Vec::kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec a = Vec::broadcast(x + r * K + k);
      acc[r][0].fma(a, b0);
      acc[r][1].fma(a, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0].store(tile + r * kGemmCols);
    acc[r][1].store(tile + r * kGemmCols + Vec::kLanes);
  }
}

// Features [n0, n0 + count) of W as panels, zero past N.
template <typename W>
void pack_panels(const W* w, int64_t w_stride, int64_t N, int64_t K, int64_t n0, int64_t count,
                 float* panels) {
  at::parallel_for(0, count / kGemmCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* dst = panels + p * K * kGemmCols;
      for (int64_t c = 0; c < kGemmCols; ++c) {
        const int64_t n = n0 + p * kGemmCols + c;
        if (n >= N) {
          for (int64_t k = 0; k < K; ++k) dst[k * kGemmCols + c] = 0.0f;
          continue;
        }
        const W* src = w + n * w_stride;
        for (int64_t k = 0; k < K; ++k) dst[k * kGemmCols + c] = widen(src[k]);
      }
    }
  });
}

template <typename W, typename Out>
void linear_gemm(const float* x, int64_t T, int64_t K, const W* w, int64_t w_stride, int64_t N,
                 const float* bias, Out* out) {
  constexpr int64_t R = Vec::kGemmTileRows;
  const int64_t panel_floats = K * kGemmCols;
  const int64_t group = std::max<int64_t>(1, kGemmPackBytes / (panel_floats * 4)) * kGemmCols;
  const int64_t row_tiles = (T + R - 1) / R;
  thread_local std::vector<float> panels;
  const int64_t padded_n = (N + kGemmCols - 1) / kGemmCols * kGemmCols;
  panels.resize(std::min(group, padded_n) * K);
  float* const packed = panels.data();  // the caller's: workers see thread_locals of their own
  for (int64_t n0 = 0; n0 < N; n0 += group) {
    const int64_t count = std::min(group, padded_n - n0);
    pack_panels(w, w_stride, N, K, n0, count, packed);
    const int64_t items = count / kGemmCols * row_tiles;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      float tile[R * kGemmCols];
      std::vector<float> last;  // the last row tile's rows, zero-padded to R
      for (int64_t i = begin; i < end; ++i) {
        const int64_t p = i / row_tiles, t0 = i % row_tiles * R, n = n0 + p * kGemmCols;
        const int64_t rows = std::min(R, T - t0), cols = std::min(kGemmCols, N - n);
        const float* xt = x + t0 * K;
        if (rows < R) {
          last.assign(R * K, 0.0f);
          std::copy(xt, xt + rows * K, last.begin());
          xt = last.data();
        }
        gemm_tile(xt, K, packed + p * panel_floats, tile);
        for (int64_t r = 0; r < rows; ++r) {
          Out* o = out + (t0 + r) * N + n;
          const float* s = tile + r * kGemmCols;
          if (bias == nullptr)
            for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<Out>(s[c]);
          else
            for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<Out>(s[c] + bias[n + c]);
        }
      }
    });
  }
}
