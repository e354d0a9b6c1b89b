// The attention paths on 8-lane vectors (attention/backends/cpu_attn_vec8.h: decode;
// cpu_prefill_vec8.h: a prefill tile) built for Arm behind one entry point, as a static
// program without a C runtime, called in an emulator by tests/kernels/test_neon_attention.py.
// `call` is a Call (decode) or a TileCall (prefill) as that test packs it.
#include <cstddef>
#include <cstdint>

#include "cpu_attn_vec8.h"
#include "cpu_prefill_vec8.h"

// What the compiler may call for the kernel's fills: no C library here.
extern "C" void* memset(void* dest, int value, size_t n) {
  auto* d = static_cast<volatile unsigned char*>(dest);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<unsigned char>(value);
  return dest;
}

struct Call {
  int64_t prefill;          // 0: this, 1: a TileCall
  int64_t dtype, head_dim;  // pages: 0 float32, 1 bf16, 2 fp16; head size 64 or 128
  const float* qf;          // [rows][D], queries times the scale
  float *acc, *sum;
  const void* cache;  // [2, blocks, block_size, kv_heads, D]
  const int32_t* blocks;
  int64_t first, seq_len, kv_head, heads, block_size, kv_heads, group, cache_half;
  float* work;
};

template <typename C, int D>
void run(const Call& c) {
  const Layout L{c.block_size, c.kv_heads, D, c.group, 0, 0, 0, c.cache_half};
  attend_vec8<C, D>(c.qf, c.acc, c.sum, static_cast<const C*>(c.cache), c.blocks, c.first,
                    c.seq_len, c.kv_head, c.heads, L, c.work);
}

template <int D>
void by_dtype(const Call& c) {
  if (c.dtype == 0) return run<float, D>(c);
  if (c.dtype == 1) return run<c10::BFloat16, D>(c);
  return run<c10::Half, D>(c);
}

struct TileCall {
  int64_t prefill, head_dim;
  const float* qs;  // [n * group][D], queries times the scale
  int64_t n, first_pos, window, group;
  const float *kt, *v;  // the KV head's widened context: K^T [D][stride], V [stride][D]
  int64_t stride;
  float *o, *inv, *s;
};

template <int D>
void run_tile(const TileCall& c) {
  prefill_tile_vec8<D>(c.qs, c.n, c.first_pos, c.window, c.group, c.kt, c.v, c.stride, 1.0f,
                       c.o, c.inv, c.s);
}

extern "C" void harness(const Call* call) {
  if (call->prefill) {
    const auto& c = *reinterpret_cast<const TileCall*>(call);
    return c.head_dim == 64 ? run_tile<64>(c) : run_tile<128>(c);
  }
  return call->head_dim == 64 ? by_dtype<64>(*call) : by_dtype<128>(*call);
}
