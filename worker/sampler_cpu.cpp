// CPU sampling kernel: greedy, temperature, top-k, top-p and min-p in about two passes
// over each row of logits (bf16 or fp32, read in place, accumulated in fp32).
//
// A random row with weights w_i = exp((x_i - max) / T) for its kept tokens (0 for the
// others) samples the first token whose cumulative weight exceeds u * sum(w), u being
// the row's uniform draw (made in Python). Pass 1 finds the max (and, for top-k, the
// k-th largest logit: kth_largest); pass 2 sums the weights per chunk of kChunk tokens;
// the chunk where the cumulative weight crosses u * sum is then walked alone. Rows are
// spread over torch's intra-op threads.
//
// Filters, in vLLM's order, each a threshold on the value so ties are kept together:
// top-k keeps x >= the k-th largest logit; top-p then keeps a token when the mass of
// the kept tokens strictly more likely than it is below p * their total (the most
// likely token is always kept); min-p then keeps w >= min_p (w of the max is 1).
// Top-p needs no sort: the weights go to a buffer and a histogram over their float
// bits (monotone in w), the bucket where the mass crosses p * total is found, and only
// that bucket's values are sorted.
#include "torch_ext.h"
#include "cpu_api.h"
#include <ATen/Parallel.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 1024;
constexpr int64_t kBlock = 64;
constexpr int kBucketShift = 20;             // 3 mantissa bits: buckets 9% wide
constexpr int kNumBuckets = (0x3F800000 >> kBucketShift) + 1;  // w in [0, 1]
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) { return splitserve::bf16_to_float(p[i]); }

inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

using splitserve::exp_nonpositive;

// A key in the order of the floats (NaN aside), and back.
inline uint32_t order_key(float f) {
  uint32_t bits = float_bits(f);
  return bits ^ (uint32_t(int32_t(bits) >> 31) | 0x80000000u);
}

inline float key_float(uint32_t key) {
  uint32_t bits = key & 0x80000000u ? key ^ 0x80000000u : ~key;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The max of a non-empty range, by keys: gcc vectorises integer max reductions as they
// are, float ones only under omp simd, which then adds up its lanes one by one (slow
// for the short ranges of blocks).
template <typename T>
float range_max(const T* x, int64_t begin, int64_t end) {
  uint32_t m = 0;
  for (int64_t i = begin; i < end; ++i) m = std::max(m, order_key(load(x, i)));
  return key_float(m);
}

// First index of the max, like torch.argmax (0 for a row of -inf).
template <typename T>
int64_t argmax(const T* x, int64_t v) {
  float best = kNegInf;
  int64_t best_chunk = 0;
  for (int64_t c = 0; c < v; c += kChunk) {
    float m = range_max(x, c, std::min(v, c + kChunk));
    if (m > best) best = m, best_chunk = c;
  }
  for (int64_t i = best_chunk; i < std::min(v, best_chunk + kChunk); ++i)
    if (load(x, i) == best) return i;
  return best_chunk;
}

struct RowParams {
  float temperature, top_p, min_p, u;
  int64_t top_k;
};

struct Scratch {
  std::vector<float> weights, floats, hist, block_max;
  std::vector<double> chunk_sums;
  std::vector<int32_t> counts;
};

// The k-th largest logit (k > 0) by radix select: counts per bucket of the top bits of
// the values' keys find the bucket that holds it, and only that bucket's values are
// selected from.
template <typename T>
float kth_largest_by_counts(const T* x, int64_t v, int64_t k, Scratch& s) {
  constexpr int kShift = 21, kNumKeyBuckets = 1 << (32 - kShift);
  s.counts.assign(4 * kNumKeyBuckets, 0);  // interleaved, as in top_p_threshold
  for (int64_t i = 0; i < v; ++i)
    s.counts[(i & 3) * kNumKeyBuckets + (order_key(load(x, i)) >> kShift)]++;
  int64_t above = 0;
  int bucket = kNumKeyBuckets - 1;
  for (;; --bucket) {
    int64_t count = s.counts[bucket] + s.counts[bucket + kNumKeyBuckets] +
                    s.counts[bucket + 2 * kNumKeyBuckets] + s.counts[bucket + 3 * kNumKeyBuckets];
    if (above + count >= k) break;
    above += count;
  }
  std::vector<float>& values = s.floats;
  values.clear();
  for (int64_t i = 0; i < v; ++i)
    if (int(order_key(load(x, i)) >> kShift) == bucket) values.push_back(load(x, i));
  auto kth = values.begin() + (k - above - 1);
  std::nth_element(values.begin(), kth, values.end(), std::greater<float>());
  return *kth;
}

// The k-th largest logit (0 < k < v), and the max. For k up to 1/256 of the vocabulary,
// the k-th largest of the maxima of blocks of 64 is a lower bound (k blocks reach it),
// seldom far below with at least 4k blocks: only the logits from it up are gathered and
// selected from. Larger k: radix select.
template <typename T>
float kth_largest(const T* x, int64_t v, int64_t k, float& max, Scratch& s) {
  if (256 * k > v) {
    max = range_max(x, 0, v);
    return kth_largest_by_counts(x, v, k, s);
  }
  int64_t num_blocks = (v + kBlock - 1) / kBlock;
  s.block_max.resize(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b)
    s.block_max[b] = range_max(x, b * kBlock, std::min(v, (b + 1) * kBlock));
  max = *std::max_element(s.block_max.begin(), s.block_max.end());
  std::vector<float>& values = s.floats;
  values.assign(s.block_max.begin(), s.block_max.end());
  std::nth_element(values.begin(), values.end() - k, values.end());
  float bound = *(values.end() - k);
  values.clear();
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (s.block_max[b] < bound) continue;
    for (int64_t i = b * kBlock; i < std::min(v, (b + 1) * kBlock); ++i)
      if (load(x, i) >= bound) values.push_back(load(x, i));
  }
  std::nth_element(values.begin(), values.end() - k, values.end());
  return *(values.end() - k);
}

// The first index whose cumulative weight exceeds u * total, weight(i) >= 0 being
// inlined into vectorised loops; -1 when the total is not positive.
template <typename Weight>
int64_t inverse_cdf(int64_t v, float u, Weight weight, std::vector<double>& chunk_sums,
                    std::vector<float>& scratch) {
  int64_t num_chunks = (v + kChunk - 1) / kChunk;
  chunk_sums.resize(num_chunks);
  double total = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    float s = 0.0f;
    int64_t end = std::min(v, (c + 1) * kChunk);
#pragma omp simd reduction(+ : s)
    for (int64_t i = c * kChunk; i < end; ++i) s += weight(i);
    chunk_sums[c] = s;
    total += s;
  }
  if (!(total > 0.0)) return -1;
  double target = double(u) * total, cumulative = 0.0;
  int64_t c = 0;
  while (c < num_chunks - 1 && cumulative + chunk_sums[c] <= target) cumulative += chunk_sums[c++];
  int64_t begin = c * kChunk, end = std::min(v, begin + kChunk);
  scratch.resize(kChunk);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) scratch[i - begin] = weight(i);
  int64_t last = -1;  // the walk's sum may round below the chunk's: its last kept token
  for (int64_t i = begin; i < end; ++i) {
    float w = scratch[i - begin];
    if (w <= 0.0f) continue;
    cumulative += w;
    if (cumulative > target) return i;
    last = i;
  }
  return last;
}

// The smallest weight top-p keeps; w holds the row's weights, total their sum.
float top_p_threshold(const std::vector<float>& w, double total, float top_p, Scratch& s) {
  // The weights under `smallest` weigh less than (1 - p) / 2 of the total together
  // (total >= 1, the max's weight), so they are never kept, and neither are the others
  // of their buckets (`smallest` is a bucket's edge): blocks of them are not counted.
  float smallest = 0.5f * (1.0f - top_p) / float(w.size());
  uint32_t edge = float_bits(smallest) >> kBucketShift << kBucketShift;
  std::memcpy(&smallest, &edge, sizeof smallest);
  int64_t v = w.size();
  // Four interleaved histograms: a bucket's additions do not wait on one another.
  s.hist.assign(4 * kNumBuckets, 0.0f);
  for (int64_t b = 0; b < v; b += kBlock) {
    int64_t end = std::min(v, b + kBlock);
    if (range_max(w.data(), b, end) < smallest) continue;
    for (int64_t i = b; i < end; ++i)
      s.hist[(i & 3) * kNumBuckets + (float_bits(w[i]) >> kBucketShift)] += w[i];
  }
  double target = double(top_p) * total, above = 0.0;
  int bucket = kNumBuckets - 1;
  for (;; --bucket) {
    float mass = s.hist[bucket] + s.hist[bucket + kNumBuckets] +
                 s.hist[bucket + 2 * kNumBuckets] + s.hist[bucket + 3 * kNumBuckets];
    if (bucket == 0 || above + mass >= target) break;
    above += mass;
  }
  // Bucket 0 holds the zero weights (no others: they are 0 or normal floats); reaching
  // it means rounding left the mass short of the target: keep every positive weight.
  if (bucket == 0) return std::numeric_limits<float>::min();
  std::vector<float>& values = s.floats;
  values.clear();
  for (int64_t b = 0; b < v; b += kBlock) {
    int64_t end = std::min(v, b + kBlock);
    if (range_max(w.data(), b, end) < smallest) continue;
    for (int64_t i = b; i < end; ++i)
      if (int(float_bits(w[i]) >> kBucketShift) == bucket) values.push_back(w[i]);
  }
  std::sort(values.begin(), values.end(), std::greater<float>());
  float threshold = values[0];
  for (size_t j = 0; j < values.size() && above < target;) {
    threshold = values[j];
    for (; j < values.size() && values[j] == threshold; ++j) above += values[j];
  }
  return threshold;
}

template <typename T>
int64_t sample_row(const T* x, int64_t v, const RowParams& p, Scratch& s) {
  float mx, threshold = kNegInf;  // top-k's, in logit space
  if (p.top_k > 0 && p.top_k < v)
    threshold = kth_largest(x, v, p.top_k, mx, s);
  else
    mx = range_max(x, 0, v);
  float inv_t = 1.0f / p.temperature, min_w = p.min_p;
  int64_t token;
  if (p.top_p < 1.0f) {
    s.weights.resize(v);
    double total = 0.0;
    for (int64_t c = 0; c < v; c += kChunk) {
      float sum = 0.0f;
      int64_t end = std::min(v, c + kChunk);
#pragma omp simd reduction(+ : sum)
      for (int64_t i = c; i < end; ++i) {
        float xi = load(x, i);
        float wi = xi >= threshold ? exp_nonpositive((xi - mx) * inv_t) : 0.0f;
        s.weights[i] = wi;
        sum += wi;
      }
      total += sum;
    }
    min_w = std::max(min_w, top_p_threshold(s.weights, total, p.top_p, s));
    const float* w = s.weights.data();
    auto weight = [w, min_w](int64_t i) { return w[i] >= min_w ? w[i] : 0.0f; };
    token = inverse_cdf(v, p.u, weight, s.chunk_sums, s.floats);
  } else {
    auto weight = [x, mx, inv_t, threshold, min_w](int64_t i) {
      float xi = load(x, i);
      float wi = exp_nonpositive((xi - mx) * inv_t);
      return xi >= threshold && wi >= min_w ? wi : 0.0f;
    };
    token = inverse_cdf(v, p.u, weight, s.chunk_sums, s.floats);
  }
  return token >= 0 ? token : argmax(x, v);
}

template <typename T>
void sample_rows(const T* logits, int64_t row_stride, int64_t v, const RowParams* params,
                 double greedy_below, int64_t* out, int64_t num_rows) {
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const T* x = logits + r * row_stride;
      const RowParams& p = params[r];
      out[r] = p.temperature < greedy_below ? argmax(x, v) : sample_row(x, v, p, scratch);
    }
  });
}

// The per-row parameter t as float32, or `fill` in each of logits' n rows.
at::Tensor float_column(const at::Tensor& logits, const c10::optional<at::Tensor>& t, float fill) {
  const int64_t n = logits.size(0);
  if (!t.has_value()) return logits.new_full({n}, fill, at::kFloat);
  TORCH_CHECK(t->numel() == n, "one sampling parameter per row");
  return t->to(at::kFloat).contiguous();
}

}  // namespace

namespace splitserve::sampler {

// logits [rows, vocab] (float32 or bfloat16, unit stride along the vocabulary); one value
// per row in every other tensor. Rows with temperature < greedy_below take the argmax.
at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature,
                     const c10::optional<at::Tensor>& top_k,
                     const c10::optional<at::Tensor>& top_p,
                     const c10::optional<at::Tensor>& min_p, const at::Tensor& u,
                     double greedy_below) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.stride(1) == 1,
              "logits: a CPU [rows, vocab] tensor with unit stride along the vocabulary");
  int64_t n = logits.size(0), v = logits.size(1);
  auto temps = float_column(logits, temperature, 1.0f), uniforms = float_column(logits, u, 0.0f);
  auto ps = float_column(logits, top_p, 1.0f), min_ps = float_column(logits, min_p, 0.0f);
  auto ks = top_k.has_value() ? top_k->to(at::kLong).contiguous()
                              : logits.new_zeros({n}, at::kLong);
  TORCH_CHECK(ks.numel() == n, "one sampling parameter per row");
  std::vector<RowParams> params(n);
  for (int64_t r = 0; r < n; ++r)
    params[r] = {temps.data_ptr<float>()[r], ps.data_ptr<float>()[r],
                 min_ps.data_ptr<float>()[r], uniforms.data_ptr<float>()[r],
                 ks.data_ptr<int64_t>()[r]};
  auto out = logits.new_empty({n}, at::kLong);
  if (logits.scalar_type() == at::kFloat) {
    sample_rows(logits.data_ptr<float>(), logits.stride(0), v, params.data(), greedy_below,
                out.data_ptr<int64_t>(), n);
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "logits: float32 or bfloat16");
    auto bits = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>());
    sample_rows(bits, logits.stride(0), v, params.data(), greedy_below,
                out.data_ptr<int64_t>(), n);
  }
  return out;
}

}  // namespace splitserve::sampler
