// The fused experts of a mixture-of-experts layer on the CPU (models/layers/moe_experts.py):
//
//   out[t] = sum_j weight[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
//
// with e = ids[t, j]; an id < 0 (an expert on another rank) adds nothing. In four steps,
// over chunks of tokens whose buffers fit the workspace a calling thread keeps:
//   1. route: a counting sort of the chunk's (token, slot) pairs by expert (serial);
//   2. pack: each pair's token row, as float32 in the tiles' order (dot_tiles.h);
//   3. gate/up: work items of (expert, tile of kUpTile intermediate features): the
//      expert's pairs times its gate and up rows of the tile, h = silu(gate) * up in
//      float32, rounded to x's dtype where the torch path (a matmul in x's dtype) rounds it;
//   4. down: work items of one tile of kDownTile hidden features each, over every expert
//      in turn: weight * (h . w2 rows) added into the tokens' float32 sums, which only that
//      item writes (no races, and each token's sum runs over its experts in id order, so
//      the result does not depend on the threads); then rounded once to x's dtype.
// Items go to the threads through an atomic counter (gate/up: largest experts first), so
// all threads work when one expert has every token, and a thread held up by another
// process delays one item, not a fixed share. A weight tile is read once per 4 pairs
// (decode: once), where it is stored: there is no per-call copy of the weights.
// Float32 and bfloat16 x and weights (all of one dtype, weights contiguous); anything else
// returns None and the caller runs the torch path.

#include "torch_ext.h"
#include "cpu_api.h"
#include "dot_tiles.h"
#include "moe_routing.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using splitserve::dot::Ahead;
using splitserve::dot::dot_block;
using splitserve::dot::kStep;
using splitserve::dot::pack_row;
using splitserve::dot::Packed;
using splitserve::moe::Routing;
using splitserve::moe::route;

constexpr int64_t kUpTile = 32;    // intermediate features per gate/up item
constexpr int64_t kDownTile = 32;  // hidden features per down item
constexpr int64_t kRowChunk = 64;  // pairs per pass over a tile (their rows stay in L2)
// The buffers of one chunk of tokens, in floats: kept by the calling thread between calls
// (32 MB at most, less if no call needed more), as fresh memory measured several times
// slower to fill. H=1024, I=256, top-8 takes 819 tokens a chunk (bf16: 744).
constexpr int64_t kWorkspaceFloats = int64_t(8) << 20;

// Runs work(i, j) for every item i, handed out one at a time to at::parallel_for's
// threads; j is the item the thread runs next (claimed ahead, for prefetching), or -1.
template <typename F>
void run_items(int64_t items, const F& work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < items;) {
      const int64_t j = next++;
      work(i, j < items ? j : -1);
      i = j;
    }
  });
}

// Where feature n of a row of k lands in its packed row (pack_row's order).
template <typename W>
inline int64_t packed_index(int64_t n, int64_t k) {
  if (sizeof(Packed<W>) == 2 || sizeof(W) == 4 || n >= k / kStep * kStep) return n;
  const int64_t i = n % kStep;
  return n - i + (i % 2) * (kStep / 2) + i / 2;
}

// One chunk: the pairs of `r`, over x rows xp (the chunk's tokens), into acc [tokens, H]
// float32, zeroed. W: the element type of x and the weights as stored (float, or uint16_t
// holding bf16); X: torch's type for it, which rounds float to nearest even; P: what the
// packed rows px (x) and ph (h) hold.
template <typename W, typename P = Packed<W>>
void fused_chunk(const W* xp, const W* w13p, const W* w2p, int64_t hidden, int64_t inter,
                 const Routing& r, P* px, P* ph, float* acc) {
  using X = std::conditional_t<sizeof(W) == 4, float, at::BFloat16>;
  const int64_t pairs = r.start.back();
  at::parallel_for(0, pairs, std::max<int64_t>(1, 16384 / hidden), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) pack_row<W>(xp + r.token[p] * hidden, hidden, px + p * hidden);
  });

  std::vector<std::pair<int64_t, int64_t>> up_items;  // (expert, first feature)
  for (int64_t e : r.active) {
    for (int64_t n = 0; n < inter; n += kUpTile) up_items.emplace_back(e, n);
  }
  auto gate_rows = [&](int64_t item) {  // the item's gate rows; its up rows follow I on
    const auto [expert, n0] = up_items[item];
    return w13p + (expert * 2 * inter + n0) * hidden;
  };
  run_items(int64_t(up_items.size()), [&](int64_t i, int64_t next) {
    const auto [expert, n0] = up_items[i];
    const int64_t cols = std::min(kUpTile, inter - n0);
    const W* gate = gate_rows(i);
    const W* up = gate + inter * hidden;
    const Ahead next_gate = next < 0 ? Ahead() : Ahead(gate_rows(next), kUpTile * hidden);
    float g[kRowChunk * kUpTile], u[kRowChunk * kUpTile];
    for (int64_t p0 = r.start[expert]; p0 < r.start[expert + 1]; p0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, r.start[expert + 1] - p0);
      const bool first = p0 == r.start[expert];
      dot_block<W>(px + p0 * hidden, hidden, rows, gate, hidden, cols, hidden, g, kUpTile,
                   first ? Ahead(up, cols * hidden) : Ahead());
      dot_block<W>(px + p0 * hidden, hidden, rows, up, hidden, cols, hidden, u, kUpTile,
                   first ? next_gate : Ahead());
      for (int64_t row = 0; row < rows; ++row) {
        P* h = ph + (p0 + row) * inter;
        for (int64_t c = 0; c < cols; ++c) {
          // Rounded as torch's matmul input is.
          const X v = splitserve::silu(g[row * kUpTile + c]) * u[row * kUpTile + c];
          if constexpr (sizeof(P) == 2) {
            h[n0 + c] = v.x;
          } else {
            h[packed_index<W>(n0 + c, inter)] = float(v);
          }
        }
      }
    }
  });

  std::vector<int64_t> by_id(r.active);
  std::sort(by_id.begin(), by_id.end());
  auto down_rows = [&](int64_t expert, int64_t n0) {
    return w2p + (expert * hidden + n0) * inter;
  };
  run_items((hidden + kDownTile - 1) / kDownTile, [&](int64_t i, int64_t next) {
    const int64_t n0 = i * kDownTile, cols = std::min(kDownTile, hidden - n0);
    float y[kRowChunk * kDownTile];
    for (size_t k = 0; k < by_id.size(); ++k) {
      const int64_t expert = by_id[k];
      // Prefetched meanwhile: the next expert's tile, or the next item's first.
      Ahead ahead;
      if (k + 1 < by_id.size()) ahead = Ahead(down_rows(by_id[k + 1], n0), kDownTile * inter);
      if (k + 1 == by_id.size() && next >= 0) {
        ahead = Ahead(down_rows(by_id[0], next * kDownTile), kDownTile * inter);
      }
      for (int64_t p0 = r.start[expert]; p0 < r.start[expert + 1]; p0 += kRowChunk) {
        const int64_t rows = std::min(kRowChunk, r.start[expert + 1] - p0);
        dot_block<W>(ph + p0 * inter, inter, rows, down_rows(expert, n0), inter, cols, inter, y,
                     kDownTile, p0 == r.start[expert] ? ahead : Ahead());
        for (int64_t row = 0; row < rows; ++row) {
          float* sum = acc + r.token[p0 + row] * hidden + n0;
          const float weight = r.weight[p0 + row];
          for (int64_t c = 0; c < cols; ++c) sum[c] += weight * y[row * kDownTile + c];
        }
      }
    }
  });
}

// All tokens, in chunks of `chunk` tokens (0: as many as the workspace holds).
template <typename W>
at::Tensor fused(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                 const at::Tensor& ids, const at::Tensor& weights, int64_t chunk) {
  using X = std::conditional_t<sizeof(W) == 4, float, at::BFloat16>;
  const int64_t tokens = x.size(0), hidden = x.size(1), inter = w2.size(2);
  const int64_t experts = w13.size(0), top_k = ids.size(1);
  const W* xp = reinterpret_cast<const W*>(x.data_ptr());
  const W* w13p = reinterpret_cast<const W*>(w13.data_ptr());
  const W* w2p = reinterpret_cast<const W*>(w2.data_ptr());
  at::Tensor out = x.new_zeros({tokens, hidden});
  // Per token: its pairs' packed x and h, and (bf16) its float32 sum.
  const int64_t per_token = top_k * (hidden + inter) + (sizeof(W) == 4 ? 0 : hidden);
  if (chunk <= 0) chunk = std::max<int64_t>(1, kWorkspaceFloats / per_token);
  thread_local std::vector<float> workspace;
  const int64_t need = std::min(tokens, chunk) * per_token;
  if (int64_t(workspace.size()) < need) workspace.resize(need);
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t t1 = std::min(tokens, t0 + chunk), n = t1 - t0;
    const Routing r = route(ids.data_ptr<int64_t>() + t0 * top_k,
                            weights.data_ptr<float>() + t0 * top_k, n * top_k, top_k, experts);
    const int64_t pairs = r.start.back();
    auto* px = reinterpret_cast<Packed<W>*>(workspace.data());
    auto* ph = px + pairs * hidden;
    X* op = out.data_ptr<X>() + t0 * hidden;
    const int64_t packed_floats = (pairs * (hidden + inter) * sizeof(*px) + 3) / 4;
    float* acc = sizeof(W) == 4 ? reinterpret_cast<float*>(op) : workspace.data() + packed_floats;
    if (sizeof(W) == 2) std::fill(acc, acc + n * hidden, 0.0f);
    fused_chunk<W>(xp + t0 * hidden, w13p, w2p, hidden, inter, r, px, ph, acc);
    if (sizeof(W) == 2) {
      at::parallel_for(0, n * hidden, 1 << 14, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) op[i] = X(acc[i]);
      });
    }
  }
  return out;
}

}  // namespace

namespace splitserve::moe {

std::optional<at::Tensor> fused_experts(const at::Tensor& x, const at::Tensor& w13,
                                        const at::Tensor& w2, const at::Tensor& topk_weights,
                                        const at::Tensor& topk_ids, int64_t chunk_tokens) {
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
  const at::Tensor xc = x.contiguous(), ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  if (dtype == at::kFloat) return fused<float>(xc, w13, w2, ids, weights, chunk_tokens);
  return fused<uint16_t>(xc, w13, w2, ids, weights, chunk_tokens);
}

}  // namespace splitserve::moe
