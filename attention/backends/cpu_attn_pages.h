// How the decode kernels see the paged cache, in plain C++ (no torch headers): what
// cpu_attn_vec8.h needs, so that tests build it for aarch64 and run it in an emulator
// (tests/kernels/test_neon_attention.py).
#pragma once

#include <cstdint>

namespace {

struct Layout {
  int64_t block_size, kv_heads, head_dim, group;
  int64_t q_row_stride, out_row_stride, table_stride;
  int64_t cache_half;  // elements between kv_cache[0] and kv_cache[1]
};

// Into L1 (prefetcht0) on Intel CPUs, into L2 (prefetcht1) on others. On AMD a prefetch
// into L1 holds one of the core's few L1 miss buffers until its line arrives, which
// bounded the decode paths at 13-14 GB/s where two threads stream 33 (2 Zen 4 cores, 64
// float32 decodes over 30 layers' pages: 2.65-2.89 ms a layer with prefetcht0, 1.93-2.03
// with prefetcht1); on 2 Emerald Rapids cores the same run takes 1.88 ms with prefetcht0,
// 2.02-2.11 with prefetcht1 (prefetchnta: 4.6). As asm: gcc 12 deletes a loop of
// __builtin_prefetch calls as having no effect. On Arm into L1 (not measured there).
#if defined(__x86_64__)
const bool kPrefetchIntoL1 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") != 0;
}();
#endif

inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  if (kPrefetchIntoL1)
    asm volatile("prefetcht0 %0" : : "m"(*p));
  else
    asm volatile("prefetcht1 %0" : : "m"(*p));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %0" : : "Q"(*p));
#else
  __builtin_prefetch(p);
#endif
}

}  // namespace
