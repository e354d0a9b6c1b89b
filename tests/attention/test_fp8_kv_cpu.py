"""fp8 KV pages on CPU: the stores (torch and C++) against the fp8 format of
attention/kv_cache_dtype.py bit for bit, scales honoured, and attention over fp8 pages by
the C++ decode and prefill kernels (every ISA this CPU has) and the torch
backend, against float64 attention over the dequantized pages (tight) and over the 16-bit
pages they were stored from (loose: the fp8 rounding)."""

import pytest
import torch
from paged_requests import random_pages, strided_q

from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from attention.kv_cache_dtype import dequantize_fp8, quantize_fp8
from attention.store_kv import store_kv_torch
from kernels import KernelSet, probe_isa
from kernels.isa import includes

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Attention over fp8 pages against the 16-bit pages they hold: e4m3 keeps 3 mantissa bits,
# e5m2 2, a relative error of up to 1/16 and 1/8 in each value and so in each score (unit
# scores here) and weight; a wrong scale or page would be off by the values' own size (~1).
LOOSE = {
    torch.float8_e4m3fn: dict(atol=0.1, rtol=0.1),
    torch.float8_e5m2: dict(atol=0.3, rtol=0.2),
}


@pytest.fixture(scope="module", params=["amx", "avx512_bf16", "avx512", "avx2", "generic"])
def kernels(request):
    native = probe_isa()
    if not includes(native, request.param):
        pytest.skip(f"this CPU has no {request.param} (it has {native})")
    module = load_cpu_attention(KernelSet(cpu=True, isa=request.param))
    assert module is not None, "the C++ kernels must build wherever the tests run (g++)"
    return module


def as_fp8(pages16: torch.Tensor, fp8: torch.dtype, k_scale: float, v_scale: float):
    """The fp8 cache that stores `pages16` ([2, ...]) with these scales, and what it reads as
    (float64)."""
    scales = (k_scale, v_scale)
    pages = torch.stack([quantize_fp8(pages16[i], scales[i], fp8) for i in range(2)])
    read = torch.stack([dequantize_fp8(pages[i], scales[i], torch.float64) for i in range(2)])
    return pages, read


def attention_reference(q, cache, table, seq_lens, starts, reqs, scale):
    """float64 causal attention of each request's query rows (the last of its context)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size, group = cache.shape[2], q.shape[1] // cache.shape[3]
    for r in reqs.tolist():
        seq_len, rows = int(seq_lens[r]), slice(int(starts[r]), int(starts[r + 1]))
        pos = torch.arange(seq_len)
        slots = table[r, pos // block_size].long(), pos % block_size
        k = cache[0][slots].double().repeat_interleave(group, dim=1)
        v = cache[1][slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), k) * scale
        query_pos = torch.arange(seq_len - scores.shape[1], seq_len)
        scores.masked_fill_(pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_stores_write_the_fp8_format(fp8, dtype, scales):
    """torch's store and the C++ store against quantize_fp8 row by row, bit for bit; values
    past the fp8 range saturate; padding (-1) and other slots stay untouched."""
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks, num_tokens = 2, 64, 16, 40, 300
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping = torch.cat([slots, torch.full((5,), -1)])
    qkv = torch.randn(len(slot_mapping) + 2, 3, num_kv_heads, head_dim, generator=gen) * 50
    qkv[0, 1, 0, :4] = torch.tensor([1e6, -1e6, 1e-9, 0.0])  # saturate, underflow, zero
    qkv = qkv.to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided rows, as views of one projection
    start = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    start = start.to(fp8)
    expected = start.clone().view(torch.uint8)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            at = (slot // block_size, slot % block_size)
            expected[0][at] = quantize_fp8(k[t], scales[0], fp8).view(torch.uint8)
            expected[1][at] = quantize_fp8(v[t], scales[1], fp8).view(torch.uint8)
    module = load_cpu_attention(KernelSet(cpu=True))
    for backend in (TorchAttentionBackend(), CPUAttentionBackend(module)):
        cache = start.clone()
        backend.store_kv(k, v, cache, slot_mapping, *scales)
        assert torch.equal(cache.view(torch.uint8), expected), backend.name
    assert not quantize_fp8(k[:1], scales[0], fp8).float().isnan().any()


def test_scales_change_the_stored_bytes_as_expected():
    """A k_scale of 2 stores x / 2: the bytes of quantize(x / 2) at scale 1, not x's."""
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(8, 1, 16, generator=gen) * 10
    v = torch.randn(8, 1, 16, generator=gen)
    slots = torch.arange(8)
    scaled, plain = (torch.zeros(2, 1, 8, 1, 16, dtype=torch.float8_e4m3fn) for _ in range(2))
    store_kv_torch(k, v, scaled, slots, k_scale=2.0, v_scale=0.5)
    store_kv_torch(k / 2, v * 2, plain, slots)
    assert torch.equal(scaled.view(torch.uint8), plain.view(torch.uint8))
    store_kv_torch(k, v, plain, slots)
    assert not torch.equal(scaled.view(torch.uint8), plain.view(torch.uint8))
    read = dequantize_fp8(scaled[0, 0], 2.0, torch.float32)
    torch.testing.assert_close(read, k[:, None].squeeze(1).view(8, 1, 16), rtol=1 / 16, atol=0)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("many", [False, True], ids=["per_head_items", "whole_requests"])
def test_cpp_decode_reads_fp8_pages(kernels, fp8, dtype, head_dim, many):
    """Few decodes: an item per (request, KV head); many (at least 8 per thread): whole
    requests per item."""
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens, kv_heads, group, block_size = [1, 15, 16, 17, 77, 300], 2, 4, 16
    if many:
        seq_lens = seq_lens + torch.randint(1, 200, (14,), generator=gen).tolist()
    pages16, table = random_pages(seq_lens, kv_heads, head_dim, block_size, dtype, gen, 1, 3)
    scales = (0.5, 1.7)
    pages, read = as_fp8(pages16, fp8, *scales)
    num_reqs = len(seq_lens)
    q = strided_q(num_reqs, kv_heads * group, kv_heads, head_dim, dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    reqs = rows = torch.arange(num_reqs)
    starts = torch.arange(num_reqs + 1, dtype=torch.int32)
    scale = head_dim**-0.5
    out = torch.zeros_like(q)
    kernels.paged_decode(out, q, pages, table, lens, reqs, rows, scale, 0, *scales)
    tight = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    expected = attention_reference(q, read, table, lens, starts, reqs, scale)
    torch.testing.assert_close(out.double(), expected, **tight)
    sixteen = attention_reference(q, pages16, table, lens, starts, reqs, scale)
    torch.testing.assert_close(out.double(), sixteen, **LOOSE[fp8])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_reads_fp8_pages(kernels, fp8, head_dim, dtype):
    """The AMX prefill (bf16 queries) and the AVX2 one (the rest, and bf16 below AMX)."""
    gen = torch.Generator().manual_seed(head_dim)
    query_lens, seq_lens, kv_heads, group, block_size = [20, 1, 33], [20, 40, 90], 2, 3, 16
    bf16 = torch.bfloat16
    pages16, table = random_pages(seq_lens, kv_heads, head_dim, block_size, bf16, gen, 1, 3)
    scales = (1.3, 0.25)
    pages, read = as_fp8(pages16, fp8, *scales)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = strided_q(int(starts[-1]), kv_heads * group, kv_heads, head_dim, dtype, gen)
    lens, reqs, scale = torch.tensor(seq_lens, dtype=torch.int32), torch.arange(3), head_dim**-0.5
    out = torch.zeros_like(q)
    if not kernels.paged_prefill(out, q, pages, table, lens, starts, reqs, scale, 0, *scales):
        assert not KernelSet(
            isa=kernels.__name__.removeprefix("splitserve_kernels_").removesuffix(".attention")
        ).has("avx2")
        return
    expected = attention_reference(q, read, table, lens, starts, reqs, scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    sixteen = attention_reference(q, pages16, table, lens, starts, reqs, scale)
    torch.testing.assert_close(out.double(), sixteen, **LOOSE[fp8])
