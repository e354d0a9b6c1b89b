// The fused experts of a mixture-of-experts layer on the CPU (models/layers/moe_experts.py):
//
//   out[t] = sum_j weight[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
//
// with e = ids[t, j]; an id < 0 (an expert on another rank) adds nothing. In five steps:
//   1. route: a counting sort of the (token, slot) pairs by expert (serial, T * k items);
//   2. pack: each pair's token row, as float32 in the tiles' order (cpu_moe_tiles.h);
//   3. gate/up: work items of (expert, tile of kUpTile intermediate features): the
//      expert's pairs times its gate and up rows of the tile, h = silu(gate) * up in
//      float32, rounded to x's dtype where the torch path (a matmul in x's dtype) rounds it;
//   4. down: items of (expert, tile of kDownTile hidden features): weight * (h . w2 rows),
//      one float32 row per pair, so no two items write one value;
//   5. combine: each token's slots' rows summed in slot order, rounded once to x's dtype.
// Items are spread over the threads by an atomic counter, largest experts first, so both
// threads work when one expert has every token, and a weight tile is read once per 4 pairs
// (decode: once). Weights are read as they are stored; there is no per-call weight copy.
// Float32 and bfloat16 x and weights (all of one dtype, weights contiguous); anything else
// returns None and the caller runs the torch path.

#include "cpu_moe_tiles.h"
#include "torch_ext.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using splitserve::moe::dot_block;
using splitserve::moe::kStep;
using splitserve::moe::pack_row;

constexpr int64_t kUpTile = 32;      // intermediate features per gate/up item
constexpr int64_t kDownTile = 64;    // hidden features per down item
constexpr int64_t kRowChunk = 64;    // pairs per pass over a tile (its rows stay in L2)

// The (token, slot) pairs sorted by expert: expert e's are order[start[e]:start[e+1]].
struct Routing {
  int64_t top_k = 0;
  std::vector<int64_t> start;
  std::vector<int64_t> token;     // the pair's token, in sorted order
  std::vector<float> weight;      // its router weight
  std::vector<int64_t> position;  // flat (t, j) -> its place in sorted order, -1 if none
};

Routing route(const at::Tensor& ids, const at::Tensor& weights, int64_t experts) {
  const int64_t pairs = ids.numel(), top_k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  Routing r;
  r.top_k = top_k;
  r.start.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK_VALUE(id[p] < experts, "topk_ids names expert ", id[p], " of ", experts);
    if (id[p] >= 0) ++r.start[id[p] + 1];
  }
  std::partial_sum(r.start.begin(), r.start.end(), r.start.begin());
  std::vector<int64_t> next(r.start.begin(), r.start.end() - 1);
  r.token.resize(r.start[experts]);
  r.weight.resize(r.start[experts]);
  r.position.assign(pairs, -1);
  for (int64_t p = 0; p < pairs; ++p) {
    if (id[p] < 0) continue;
    const int64_t at = next[id[p]]++;
    r.token[at] = p / top_k;
    r.weight[at] = w[p];
    r.position[p] = at;
  }
  return r;
}

// Runs work(i) for every item i, handed out one at a time to at::parallel_for's threads.
template <typename F>
void run_items(int64_t items, const F& work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < items; i = next++) work(i);
  });
}

// (expert, first feature) of every tile of `features`, over the experts with pairs, the
// experts with most pairs first.
std::vector<std::pair<int64_t, int64_t>> tiles(const Routing& r, int64_t features,
                                               int64_t tile) {
  std::vector<int64_t> experts;
  for (int64_t e = 0; e + 1 < int64_t(r.start.size()); ++e) {
    if (r.start[e + 1] > r.start[e]) experts.push_back(e);
  }
  std::stable_sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) {
    return r.start[a + 1] - r.start[a] > r.start[b + 1] - r.start[b];
  });
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t e : experts) {
    for (int64_t n = 0; n < features; n += tile) items.emplace_back(e, n);
  }
  return items;
}

// Where feature n of a row of k lands in its packed row (pack_row's order).
template <typename W>
inline int64_t packed_index(int64_t n, int64_t k) {
  if (sizeof(W) == 4 || n >= k / kStep * kStep) return n;
  const int64_t i = n % kStep;
  return n - i + (i % 2) * (kStep / 2) + i / 2;
}

inline float silu(float g) {
  // g * sigmoid(g), with exp's argument kept <= 0 so that it cannot overflow.
  const float e = splitserve::exp_nonpositive(-std::abs(g));
  return g >= 0 ? g / (1.0f + e) : g * e / (1.0f + e);
}

// W: the element type of x and the weights as stored (float, or uint16_t for bf16 bits);
// X: the same as torch's type, which rounds float to it (to nearest even).
template <typename W>
at::Tensor fused(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                 const Routing& r) {
  const int64_t tokens = x.size(0), hidden = x.size(1), inter = w2.size(2);
  const int64_t pairs = r.start.back(), top_k = r.top_k;
  using X = std::conditional_t<sizeof(W) == 4, float, at::BFloat16>;
  const W* xp = reinterpret_cast<const W*>(x.data_ptr());
  const W* w13p = reinterpret_cast<const W*>(w13.data_ptr());
  const W* w2p = reinterpret_cast<const W*>(w2.data_ptr());
  auto floats = x.options().dtype(at::kFloat);
  at::Tensor packed_x = at::empty({pairs, hidden}, floats);
  at::Tensor packed_h = at::empty({pairs, inter}, floats);
  at::Tensor rows = at::empty({pairs, hidden}, floats);
  float* px = packed_x.data_ptr<float>();
  float* ph = packed_h.data_ptr<float>();
  float* py = rows.data_ptr<float>();

  at::parallel_for(0, pairs, std::max<int64_t>(1, 16384 / hidden), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) pack_row<W>(xp + r.token[p] * hidden, hidden, px + p * hidden);
  });

  const auto up_items = tiles(r, inter, kUpTile);
  run_items(int64_t(up_items.size()), [&](int64_t i) {
    const auto [expert, n0] = up_items[i];
    const int64_t cols = std::min(kUpTile, inter - n0);
    const W* gate = w13p + (expert * 2 * inter + n0) * hidden;
    const W* up = gate + inter * hidden;
    float g[kRowChunk * kUpTile], u[kRowChunk * kUpTile];
    for (int64_t p0 = r.start[expert]; p0 < r.start[expert + 1]; p0 += kRowChunk) {
      const int64_t n_rows = std::min(kRowChunk, r.start[expert + 1] - p0);
      dot_block<W>(px + p0 * hidden, hidden, n_rows, gate, hidden, cols, hidden, g, kUpTile);
      dot_block<W>(px + p0 * hidden, hidden, n_rows, up, hidden, cols, hidden, u, kUpTile);
      for (int64_t row = 0; row < n_rows; ++row) {
        float* h = ph + (p0 + row) * inter;
        for (int64_t c = 0; c < cols; ++c) {
          const float v = silu(g[row * kUpTile + c]) * u[row * kUpTile + c];
          h[packed_index<W>(n0 + c, inter)] = float(X(v));  // rounded as torch's matmul input
        }
      }
    }
  });

  const auto down_items = tiles(r, hidden, kDownTile);
  run_items(int64_t(down_items.size()), [&](int64_t i) {
    const auto [expert, n0] = down_items[i];
    const int64_t cols = std::min(kDownTile, hidden - n0);
    const W* down = w2p + (expert * hidden + n0) * inter;
    const int64_t p0 = r.start[expert], n_rows = r.start[expert + 1] - p0;
    dot_block<W>(ph + p0 * inter, inter, n_rows, down, inter, cols, inter, py + p0 * hidden + n0,
                 hidden);
    for (int64_t p = p0; p < p0 + n_rows; ++p) {
      for (int64_t c = 0; c < cols; ++c) py[p * hidden + n0 + c] *= r.weight[p];
    }
  });

  at::Tensor out = at::empty({tokens, hidden}, x.options());
  X* op = out.data_ptr<X>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / hidden), [&](int64_t b, int64_t e) {
    std::vector<float> sum(hidden);
    for (int64_t t = b; t < e; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t p = r.position[t * top_k + j];
        if (p < 0) continue;
        for (int64_t n = 0; n < hidden; ++n) sum[n] += py[p * hidden + n];
      }
      for (int64_t n = 0; n < hidden; ++n) op[t * hidden + n] = X(sum[n]);
    }
  });
  return out;
}

std::optional<at::Tensor> fused_experts(const at::Tensor& x, const at::Tensor& w13,
                                        const at::Tensor& w2, const at::Tensor& topk_weights,
                                        const at::Tensor& topk_ids) {
  const auto dtype = x.scalar_type();
  const bool takes = x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                     w13.scalar_type() == dtype && w2.scalar_type() == dtype &&
                     w13.device().is_cpu() && w2.device().is_cpu() && w13.is_contiguous() &&
                     w2.is_contiguous() && topk_ids.device().is_cpu() &&
                     topk_weights.device().is_cpu();
  if (!takes) return std::nullopt;
  TORCH_CHECK_VALUE(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
                    "fused_experts takes x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t experts = w13.size(0), hidden = x.size(1), inter = w2.size(2);
  TORCH_CHECK_VALUE(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(0) == experts &&
                        w2.size(1) == hidden,
                    "w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit x ", x.sizes());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                        topk_weights.sizes() == topk_ids.sizes(),
                    "topk_ids ", topk_ids.sizes(), " and topk_weights ", topk_weights.sizes(),
                    " must both be [T, k] for x ", x.sizes());
  const Routing r = route(topk_ids.to(at::kLong).contiguous(),
                          topk_weights.to(at::kFloat).contiguous(), experts);
  const at::Tensor xc = x.contiguous();
  if (r.start.back() == 0) return at::zeros_like(xc);
  if (dtype == at::kFloat) return fused<float>(xc, w13, w2, r);
  return fused<uint16_t>(xc, w13, w2, r);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_experts", &fused_experts,
        "sum_j weight[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t]; None if not taken",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("topk_weights"),
        py::arg("topk_ids"), py::call_guard<py::gil_scoped_release>());
}
