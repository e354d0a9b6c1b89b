// The quantized weights' strips and the per-call int8 activations as the CPU kernels read
// them, in plain C++ (no torch headers), so that the Arm strip passes built on them
// (cpu_quant_strips_neon.h) build without ATen for aarch64 and run in an emulator
// (tests/kernels/test_neon_strips.py).
#pragma once

#include <cstdint>

namespace splitserve::quant {

constexpr int64_t kRun = 32;    // elements per run, and per activation scale
constexpr int64_t kStrip = 8;  // features per strip

// One call's x quantized per run, rows of K features: q (int8; for the AVX-512 row kernels,
// pair_order, each pair of runs in pair order, as q4_pair), d [M, runs], the scale pattern
// of each pair's lanes dv [M, pairs, 16] (pair order), and where the weight has mins the
// sum of the dequantized x over each weight block, sums [M, blocks]. half_block[h]: the
// weight block of features 16h .. 16h + 15; for each pair (pair order), the weight scales
// its lanes take (pair_scales): scale_lanes [pairs, 16] and scale_masks [pairs]. offset:
// q stores x + 128 as unsigned bytes instead (d and sums as without).
struct Acts {
  const int8_t* q;
  const float *d, *dv, *sums;
  const int32_t *half_block, *scale_lanes;
  const uint8_t* scale_masks;
  int64_t runs, pairs;
};

// A weight in strips (models/quantization/strips.py; cpu_quant_strips.cpp says the layout):
// q [N / 8, 8 * row bytes], scales and mins [N / 8, blocks, 8], float16 (half) or float32.
struct Strips {
  const uint8_t* q;
  const void* scales;
  const void* mins;
  bool half;
  int64_t N, K, bits, block_size;

  int64_t run_bytes() const { return bits == 4 ? 4 * 32 : 8 * 32; }
  int64_t strip_bytes() const { return K / 32 * run_bytes(); }
  int64_t blocks() const { return K / block_size; }
};

}  // namespace splitserve::quant
