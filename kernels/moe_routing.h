// The routing step every fused-experts kernel starts from: a counting sort of a chunk's
// (token, slot) pairs by expert (models/layers/cpu_moe.cpp, models/quantization/cpu_quant_moe.cpp).
#pragma once

#include "torch_ext.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace splitserve::moe {

// The (token, slot) pairs of tokens [t0, t1) sorted by expert: expert e's are
// [start[e], start[e + 1]), with their tokens (from t0) and router weights.
struct Routing {
  std::vector<int64_t> start;
  std::vector<int64_t> token;
  std::vector<float> weight;
  std::vector<int64_t> active;  // the experts with pairs, most pairs first
  int64_t rows(int64_t e) const { return start[e + 1] - start[e]; }
};

inline Routing route(const int64_t* id, const float* w, int64_t pairs, int64_t top_k,
                     int64_t experts) {
  Routing r;
  r.start.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK_VALUE(id[p] < experts, "topk_ids names expert ", id[p], " of ", experts);
    if (id[p] >= 0) ++r.start[id[p] + 1];
  }
  std::partial_sum(r.start.begin(), r.start.end(), r.start.begin());
  std::vector<int64_t> next(r.start.begin(), r.start.end() - 1);
  r.token.resize(r.start[experts]);
  r.weight.resize(r.start[experts]);
  for (int64_t p = 0; p < pairs; ++p) {
    if (id[p] < 0) continue;
    const int64_t at = next[id[p]]++;
    r.token[at] = p / top_k;
    r.weight[at] = w[p];
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (r.rows(e) > 0) r.active.push_back(e);
  }
  std::stable_sort(r.active.begin(), r.active.end(),
                   [&](int64_t a, int64_t b) { return r.rows(a) > r.rows(b); });
  return r;
}

}  // namespace splitserve::moe
