// The GEMM of cpu_dense_linear.cpp (included there, inside its namespace, after Vec and
// widen): out = x W^T (+ bias) in float32 math, W float32 or bf16 [N, K].
//
// W is packed into panels of kGemmCols features, [K][kGemmCols] each: once at load
// (pack_weight_panels: every row count then runs here, the panels read as one sequential stream
// each), float32 panels of a float32 W, bf16 panels of a bf16 W (half the bytes, widened as a tile
// loads them: Vec::load_pair); other weights per call from kGemmRows rows on, a group at a time
// (bf16 widened on the way, zero past N). A tile is up to Vec::kGemmTileRows rows x kGemmCols
// features (a block's rows in tiles of even sizes), 2 vectors of accumulators a row: per k, the
// panel's two vectors and one broadcast x value a row (x as it is, rows K apart). AVX-512F tiles of
// up to 14 rows (28 accumulators of 32 registers), AVX2 6 (12 of 16); a whole tile of float32
// output is stored (with the bias) from the registers. x goes in blocks of kGemmBlockBytes of rows,
// and a block's work items are (panel, row tile) pairs, panel by panel: a thread reuses its panel
// from L1/L2 across the block's row tiles, and the block from L2. On 2 Zen 4 cores, SmolLM2's four
// layer shapes at 2048 rows (qkv, o, gate_up, down), x and W in cache: 184-197 GFLOP/s with the
// packing, where torch's float32 GEMM ran at 134-167 in the same runs (peak 228); packing x as well
// measured slower. The compare_cpu float32 workload's prefill steps: 25 % less time; with the
// panels made at load, decode steps 9 %.
#pragma once

constexpr int64_t kGemmPackBytes = 8 << 20;  // the panels packed at a time
constexpr int64_t kGemmBlockBytes = 512 << 10;  // the rows of x a block
// Features [n0, n0 + count) of W as panels of P (float32, or bf16 from a bf16 W), zero
// past N.
template <typename W, typename P>
void pack_panels(const W* w, int64_t w_stride, int64_t N, int64_t K, int64_t n0, int64_t count,
                 P* panels) {
  static_assert(std::is_same_v<P, float> || std::is_same_v<P, W>);
  at::parallel_for(0, count / kGemmCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      P* dst = panels + p * K * kGemmCols;
      for (int64_t c = 0; c < kGemmCols; ++c) {
        const int64_t n = n0 + p * kGemmCols + c;
        P* col = dst + (std::is_same_v<P, float> ? c : Vec::pair_slot(c));
        if (n >= N) {
          for (int64_t k = 0; k < K; ++k) col[k * kGemmCols] = P{0};
          continue;
        }
        const W* src = w + n * w_stride;
        for (int64_t k = 0; k < K; ++k) {
          if constexpr (std::is_same_v<P, float>)
            col[k * kGemmCols] = widen(src[k]);
          else
            col[k * kGemmCols] = src[k];
        }
      }
    }
  });
}

// Output features [n0, n0 + count) from their panels (count a multiple of kGemmCols; the
// features from N on are dropped).
template <typename P, typename Out>
void gemm_panels(const float* x, int64_t T, int64_t K, const P* panels, int64_t n0,
                 int64_t count, int64_t N, const float* bias, Out* out) {
  constexpr int64_t R = Vec::kGemmTileRows;
  const int64_t panel_size = K * kGemmCols;
  const int64_t panel_lines = panel_size * int64_t(sizeof(P)) / kLineBytes;
  const int64_t block_rows = std::max<int64_t>(1, kGemmBlockBytes / (K * 4 * R)) * R;
  for (int64_t b0 = 0; b0 < T; b0 += block_rows) {
    // The block's rows in tiles of even sizes (32 rows: 11 + 11 + 10, not 14 + 14 + 4).
    const int64_t block = std::min(block_rows, T - b0), tiles = (block + R - 1) / R;
    const int64_t base = block / tiles, extra = block % tiles;
    at::parallel_for(0, count / kGemmCols * tiles, 1, [&](int64_t begin, int64_t end) {
      float tile[Vec::kGemmTileRows * kGemmCols];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t p = i / tiles, j = i % tiles, n = n0 + p * kGemmCols;
        const int64_t t0 = b0 + j * base + std::min(j, extra);
        const int rows = static_cast<int>(base + (j < extra));
        const int64_t cols = std::min(kGemmCols, N - n);
        const float* xt = x + t0 * K;
        const P* panel = panels + p * panel_size;
        const float* b = bias == nullptr ? nullptr : bias + n;
        Prefetch prefetch;  // this thread's first panel ahead of itself, then the next
        const char* bytes = reinterpret_cast<const char*>(panel);
        if (i == begin) {
          prefetch = {bytes + kGemmAheadBytes, panel_lines};
        } else if ((p + 1) * tiles < end) {
          const int64_t first = panel_lines * j / tiles;
          prefetch = {reinterpret_cast<const char*>(panel + panel_size) + first * kLineBytes,
                      panel_lines * (j + 1) / tiles - first};
        }
        if constexpr (std::is_same_v<Out, float>) {
          if (cols == kGemmCols) {
            gemm_rows(rows, xt, K, panel, b, out + t0 * N + n, N, prefetch);
            continue;
          }
        }
        gemm_rows(rows, xt, K, panel, nullptr, tile, kGemmCols, prefetch);
        for (int64_t r = 0; r < rows; ++r) {
          Out* o = out + (t0 + r) * N + n;
          const float* s = tile + r * kGemmCols;
          if (b == nullptr)
            for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<Out>(s[c]);
          else
            for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<Out>(s[c] + b[c]);
        }
      }
    });
  }
}

// W packed here, a group of panels at a time.
template <typename W, typename Out>
void linear_gemm(const float* x, int64_t T, int64_t K, const W* w, int64_t w_stride, int64_t N,
                 const float* bias, Out* out) {
  const int64_t panel_floats = K * kGemmCols;
  const int64_t group = std::max<int64_t>(1, kGemmPackBytes / (panel_floats * 4)) * kGemmCols;
  const int64_t padded_n = (N + kGemmCols - 1) / kGemmCols * kGemmCols;
  thread_local std::vector<float> panels;
  panels.resize(std::min(group, padded_n) * K);
  float* const packed = panels.data();  // the caller's: workers see thread_locals of their own
  for (int64_t n0 = 0; n0 < N; n0 += group) {
    const int64_t count = std::min(group, padded_n - n0);
    pack_panels(w, w_stride, N, K, n0, count, packed);
    gemm_panels(x, T, K, packed, n0, count, N, bias, out);
  }
}
