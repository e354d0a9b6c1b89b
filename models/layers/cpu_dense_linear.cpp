// Dense linear layers in float32 math, for CPUs without bf16 instructions: out = x W^T
// (+ bias) for W [N, K] as the layer holds it (rows dense), bf16 or float32.
//   - bf16 W, x float32 or bf16 [T, K]: the weights stay bf16 in memory, half the bytes of
//     float32 (the cost of a decode step), and are widened to float32 in registers (a bf16
//     is the top half of a float: a shift), multiplied with FMA and summed in float32; the
//     result rounds to x's dtype once, after the bias, as F.linear's.
//   - float32 W and x, where this kernel beats torch's float32 GEMM at every row count.
//   A W whose N is a multiple of the panel width is held as the GEMM's panels
//   (pack_weight_panels, at load: float32 or bf16 as W), which every row count multiplies
//   (cpu_gemm.h; SmolLM2's bf16 weights as panels on 2 Emerald Rapids cores, AVX-512F
//   build: 16 rows 39 -> 15 ms, 64 rows 76 -> 47, 1024 rows 816 -> 730; AVX2 build: 16
//   rows 39 -> 22, 64 rows 102 -> 78); the paths below take the others.
//
// By the number of rows T (measured on SmolLM2's layers, 2 Zen 3 cores):
//   - T < kPanelRows, where reading the weights is the cost (`linear_rows`): tiles of F
//     output features x R rows as F * R dot products along K, one vector accumulator each,
//     whose lanes are summed at the end; the next F weight rows are prefetched as these
//     are read. The rows go in chunks that stay in L2 (kChunkBytes); within a chunk the
//     threads share the features in groups of F, and a thread walks the chunk's rows R at
//     a time while its F weight rows stay in L1. AVX-512F: 16 lanes, F 4 x R 6; AVX2: 8
//     lanes, F 3 x R 4 (12 accumulators of 16 registers; Arm NEON the same tiles, on
//     cpu_vec8.h's 8 lanes); generic code: 8 lanes the compiler vectorises as it can,
//     F 2 x R 2 (the tiles and Vec: cpu_dense_tiles.h). 18 GB/s of weights at one row,
//     twice torch's float32 GEMM at 1 to 8 rows.
//   - up to kGemmRows (`linear_panels`): out^T = W x^T as a GEMM with x transposed into
//     tiles of 2 vectors of rows, 6 features x 2 vectors of accumulators, a broadcast
//     weight per feature and k: about 145-150 GFLOP/s at 64-256 rows, where torch's float32
//     GEMM reaches 90-135. The first tile prefetches the next group's float32 weight rows
//     (2 Zen 4 cores, SmolLM2's layers: 16-32 rows 43-47 -> 37-40 ms, 64 rows 76 -> 71);
//     a last tile of one vector's rows or fewer takes one vector (16 rows there: 37 -> 28).
//   - from kGemmRows on (`linear_gemm`, cpu_gemm.h): W packed per call into panels of
//     features, a tile of rows x 2 vectors of features per k.
//
// dense_linear says which tensors it takes: it returns None for the others (the layer then
// runs F.linear, on the weight widened to x's dtype).
#include "torch_ext.h"

#include "cpu_api.h"
#include "cpu_dense_tiles.h"
#include "cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int kF = Vec::kFeatures, kR = Vec::kRows;
constexpr int64_t kChunkBytes = 192 * 1024;  // x rows of a chunk: about half an L2
constexpr int64_t kPanelRows = 16;  // from here on linear_panels
constexpr int64_t kGemmRows = 768;  // from here on linear_gemm (cpu_gemm.h)

// F features (rows of w) of `rows` rows of x, R rows at a time.
template <int F, typename W, typename Out>
void feature_group(const W* w, int64_t w_stride, const float* x, int64_t K,
                   int64_t rows, const float* bias, Out* out, int64_t out_stride) {
  float sums[kR * F];
  for (int64_t r = 0; r < rows; r += kR) {
    const int64_t n = std::min<int64_t>(kR, rows - r);
    dot_rows<F, kR, W>(n, w, w_stride, x + r * K, K, sums);
    for (int64_t i = 0; i < n; ++i)
      for (int f = 0; f < F; ++f)
        out[(r + i) * out_stride + f] =
            static_cast<Out>(sums[i * F + f] + (bias == nullptr ? 0.0f : bias[f]));
  }
}

template <typename W, typename Out>
void linear_rows(const float* x, int64_t T, int64_t K, const W* w, int64_t w_stride,
                 int64_t N, const float* bias, Out* out) {
  const int64_t chunk = std::max<int64_t>(kR, kChunkBytes / (K * int64_t(sizeof(float))) / kR * kR);
  const int64_t groups = (N + kF - 1) / kF;
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t rows = std::min(chunk, T - t0);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n = g * kF;
        const float* b = bias == nullptr ? nullptr : bias + n;
        Out* o = out + t0 * N + n;
        if (n + kF <= N) {
          feature_group<kF, W, Out>(w + n * w_stride, w_stride, x + t0 * K, K, rows, b, o, N);
          continue;
        }
        for (int64_t f = 0; n + f < N; ++f)
          feature_group<1, W, Out>(w + (n + f) * w_stride, w_stride, x + t0 * K, K, rows,
                           b == nullptr ? nullptr : b + f, o + f, N);
      }
    });
  }
}

// Panels, for more rows: out^T = W x^T, x transposed once into tiles of kTileRows rows
// (xt[tile][k][kTileRows]), a tile of kPanelFeatures features x kTileRows rows in
// 2 x kPanelFeatures accumulators: per k, kPanelVecs vectors of x and one broadcast
// weight per feature, no lanes to sum. The features' weight rows, widened once into a
// buffer of the thread (a float32 weight as it is), stay in L1 while the thread walks the
// tiles.
constexpr int kPanelFeatures = 6, kPanelVecs = 2;
constexpr int64_t kTileRows = kPanelVecs * Vec::kLanes;

template <int V>
inline void panel_tile(const float* w, int64_t w_stride, const float* xt, int64_t K,
                       const float* next, float* tile) {
  Vec acc[kPanelFeatures][V];
  for (auto& row : acc)
    for (auto& a : row) a = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr && k % 16 == 0)
      for (int f = 0; f < kPanelFeatures; ++f) __builtin_prefetch(next + f * w_stride + k);
    Vec xv[V];
    for (int v = 0; v < V; ++v) xv[v] = Vec::load(xt + k * kTileRows + v * Vec::kLanes);
    for (int f = 0; f < kPanelFeatures; ++f) {
      const Vec b = Vec::broadcast(w + f * w_stride + k);
      for (int v = 0; v < V; ++v) acc[f][v].fma(b, xv[v]);
    }
  }
  for (int f = 0; f < kPanelFeatures; ++f)
    for (int v = 0; v < V; ++v) acc[f][v].store(tile + f * kTileRows + v * Vec::kLanes);
}

// A tile of one vector of rows, not inlined: inlined into linear_panels' lambda, GCC kept
// its accumulators on the stack, stored every k (1.8x slower on AVX-512). The two-vector
// tile is inlined: out of line, GCC 12 did that to it on AVX2 (2x slower at 32-64 rows).
__attribute__((noinline)) void panel_tile_one(const float* w, int64_t w_stride, const float* xt,
                                              int64_t K, const float* next, float* tile) {
  panel_tile<1>(w, w_stride, xt, K, next, tile);
}

template <typename W, typename Out>
void linear_panels(const float* x, int64_t T, int64_t K, const W* w, int64_t w_stride,
                   int64_t N, const float* bias, Out* out) {
  const int64_t chunk =
      std::max<int64_t>(1, 2 * kChunkBytes / (K * int64_t(sizeof(float))) / kTileRows) * kTileRows;
  const int64_t groups = (N + kPanelFeatures - 1) / kPanelFeatures;
  std::vector<float> xt(std::min(chunk, (T + kTileRows - 1) / kTileRows * kTileRows) * K);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t rows = std::min(chunk, T - t0), tiles = (rows + kTileRows - 1) / kTileRows;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t t = i * kTileRows + r;
          float* dst = xt.data() + i * K * kTileRows + r;
          const float* src = x + (t0 + t) * K;
          if (t < rows)
            for (int64_t k = 0; k < K; ++k) dst[k * kTileRows] = src[k];
          else
            for (int64_t k = 0; k < K; ++k) dst[k * kTileRows] = 0.0f;
        }
    });
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(kPanelFeatures * K, 0.0f);
      float tile[kPanelFeatures * kTileRows];
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n = g * kPanelFeatures;
        const int64_t features = std::min<int64_t>(kPanelFeatures, N - n);
        const float* wf = widened.data();
        int64_t wf_stride = K;
        if (std::is_same_v<W, float> && features == kPanelFeatures) {
          wf = reinterpret_cast<const float*>(w + n * w_stride);
          wf_stride = w_stride;
        } else {
          for (int64_t f = 0; f < kPanelFeatures; ++f) {
            float* dst = widened.data() + f * K;
            const W* src = w + (n + f) * w_stride;
            if (f < features) {
#pragma omp simd
              for (int64_t k = 0; k < K; ++k) dst[k] = widen(src[k]);
            } else {
              std::fill(dst, dst + K, 0.0f);
            }
          }
        }
        for (int64_t i = 0; i < tiles; ++i) {
          const int64_t r0 = i * kTileRows, count = std::min(kTileRows, rows - r0);
          // The next group's weight rows, prefetched while the first tile reads these: the
          // hardware prefetchers start each row's stream late.
          const bool next = i == 0 && g + 1 < end && wf != widened.data();
          const float* nw = next ? wf + kPanelFeatures * wf_stride : nullptr;
          const float* xti = xt.data() + i * K * kTileRows;
          if (count <= Vec::kLanes)
            panel_tile_one(wf, wf_stride, xti, K, nw, tile);
          else
            panel_tile<kPanelVecs>(wf, wf_stride, xti, K, nw, tile);
          Out* o = out + (t0 + r0) * N + n;
          for (int64_t r = 0; r < count; ++r)
            for (int64_t f = 0; f < features; ++f)
              o[r * N + f] = static_cast<Out>(tile[f * kTileRows + r] +
                                              (bias == nullptr ? 0.0f : bias[n + f]));
        }
      }
    });
  }
}

#include "cpu_gemm.h"

// run(w, out) on the elements of a float32 W and out, or of a bf16 W and out in x's dtype
// (float32 or bf16).
template <typename Run>
void with_types(const at::Tensor& w, at::Tensor& out, const Run& run) {
  if (w.scalar_type() == at::kFloat) return run(w.data_ptr<float>(), out.data_ptr<float>());
  const auto* w16 = reinterpret_cast<const uint16_t*>(w.data_ptr());
  if (out.scalar_type() == at::kFloat)
    run(w16, out.data_ptr<float>());
  else
    run(w16, out.data_ptr<at::BFloat16>());
}

// x [T, K] W^T (+ bias) for W as pack_weight_panels made it: float32 panels and float32 x,
// bf16 panels and float32 or bf16 x (the result in x's dtype); None for others.
std::optional<at::Tensor> panels_linear(const at::Tensor& x, const at::Tensor& panels,
                                        const std::optional<at::Tensor>& bias) {
  const int64_t K = panels.size(1), N = panels.size(0) * kGemmCols;
  const bool bf16_p = panels.scalar_type() == at::kBFloat16;
  const bool float_x = x.scalar_type() == at::kFloat;
  if (!panels.device().is_cpu() || !(bf16_p || panels.scalar_type() == at::kFloat) ||
      panels.size(2) != kGemmCols || !panels.is_contiguous() || !x.device().is_cpu() ||
      !(float_x || (bf16_p && x.scalar_type() == at::kBFloat16)) || x.dim() != 2 ||
      x.size(1) != K || (bias.has_value() && bias->numel() != N))
    return std::nullopt;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  auto out = x.new_empty({x.size(0), N});
  if (x.size(0) == 0 || N == 0) return out;
  with_types(panels, out, [&](const auto* p, auto* o) {
    gemm_panels(xf.data_ptr<float>(), x.size(0), K, p, 0, N, N, b, o);
  });
  return out;
}

}  // namespace

namespace splitserve::dense {

// A float32 or bf16 weight [N, K] as the panels [N / kGemmCols, K, kGemmCols] of its dtype
// that dense_linear takes in its place (any rows: the panels stream in order, where a few
// rows' dot tiles read kFeatures rows at once); None where N is not a multiple of kGemmCols.
std::optional<at::Tensor> pack_weight_panels(const at::Tensor& weight) {
  const bool bf16_w = weight.scalar_type() == at::kBFloat16;
  if (!weight.device().is_cpu() || weight.dim() != 2 ||
      !(bf16_w || weight.scalar_type() == at::kFloat) || weight.stride(1) != 1 ||
      weight.size(0) % kGemmCols != 0)
    return std::nullopt;
  const int64_t N = weight.size(0), K = weight.size(1);
  auto panels = weight.new_empty({N / kGemmCols, K, kGemmCols});
  if (bf16_w)
    pack_panels(reinterpret_cast<const uint16_t*>(weight.data_ptr()), weight.stride(0), N, K, 0,
                N, reinterpret_cast<uint16_t*>(panels.data_ptr()));
  else
    pack_panels(weight.data_ptr<float>(), weight.stride(0), N, K, 0, N, panels.data_ptr<float>());
  return panels;
}

// x [T, K] W^T (+ bias) for W [N, K] with dense rows: bf16 W and float32 or bf16 x, or
// float32 W and x; or for W's panels (pack_weight_panels, panels_linear); None for other
// tensors.
std::optional<at::Tensor> dense_linear(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias) {
  if (weight.dim() == 3) return panels_linear(x, weight, bias);
  const bool float_x = x.scalar_type() == at::kFloat;
  const bool bf16_w = weight.scalar_type() == at::kBFloat16;
  if (!weight.device().is_cpu() || weight.dim() != 2 || weight.stride(1) != 1 ||
      !x.device().is_cpu() || x.dim() != 2 || x.size(1) != weight.size(1))
    return std::nullopt;
  if (bf16_w ? !(float_x || x.scalar_type() == at::kBFloat16)
             : !(weight.scalar_type() == at::kFloat && float_x))
    return std::nullopt;
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  if (bias.has_value() && bias->numel() != N) return std::nullopt;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  auto out = x.new_empty({T, N});
  if (T == 0 || N == 0) return out;
  const float* xp = xf.data_ptr<float>();
  const int64_t ws = weight.stride(0);
  auto run = [&](const auto* w, auto* o) {
    if (T >= kGemmRows)
      linear_gemm(xp, T, K, w, ws, N, b, o);
    else if (T >= kPanelRows)
      linear_panels(xp, T, K, w, ws, N, b, o);
    else
      linear_rows(xp, T, K, w, ws, N, b, o);
  };
  with_types(weight, out, run);
  return out;
}

}  // namespace splitserve::dense
