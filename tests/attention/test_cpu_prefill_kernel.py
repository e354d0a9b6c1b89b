"""The C++ prefill kernels (attention/backends/cpu_prefill_amx.h for bf16 on AMX CPUs,
cpu_prefill_widened.h for the rest from AVX2 up) against causal attention computed in
float64 over each request's context gathered by hand from random page tables: fresh
prompts, cached prefixes and chunks, GQA groups, head sizes 64/128, float32/bf16/fp16,
sliding windows. Built for every ISA rung this CPU runs, so an AMX machine tests the AVX2
kernel too (forced avx2). And what they decline: they say so, and the CPU backend's torch
prefill runs instead."""

import pytest
import torch
from paged_requests import PagedRequests, random_pages, strided_q

from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from kernels import KernelSet
from kernels.isa import probe_isa, rungs
from tests.quantization.isas import kernel_isas

# The rungs from which on a build has a prefill kernel, up to this CPU's own.
PREFILL_ISAS = [r for r in rungs(probe_isa()) if r in ("avx2", "amx")]
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    # bf16/fp16 q and pages, rounded outputs (AMX: bf16 probabilities too)
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


@pytest.fixture(scope="module", params=PREFILL_ISAS)
def kernels(request):
    if not PREFILL_ISAS:
        pytest.skip("no prefill kernel below AVX2: the torch prefill path runs")
    module = load_cpu_attention(KernelSet(cpu=True, isa=request.param))
    assert module is not None, "the C++ kernels must build wherever the tests run (g++)"
    return module


def prefill_case(query_lens, seq_lens, kv_heads, group, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache, table = random_pages(seq_lens, kv_heads, head_dim, block_size, dtype, gen, 1, 3)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = strided_q(int(starts[-1]), kv_heads * group, kv_heads, head_dim, dtype, gen)
    return q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


def reference(q, cache, table, seq_lens, starts, reqs, scale, window=0):
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size, group = cache.shape[2], q.shape[1] // cache.shape[3]
    for r in reqs.tolist():
        seq_len, rows = int(seq_lens[r]), slice(int(starts[r]), int(starts[r + 1]))
        pos = torch.arange(seq_len)
        slots = table[r, pos // block_size].long(), pos % block_size
        k = cache[0][slots].double().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = cache[1][slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), k) * scale
        query_pos = torch.arange(seq_len - scores.shape[1], seq_len)
        hidden = pos[None, None, :] > query_pos[None, :, None]
        if window:
            hidden |= pos[None, None, :] <= query_pos[None, :, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def check(
    kernels,
    query_lens,
    seq_lens,
    kv_heads,
    group,
    head_dim,
    block_size,
    reqs=None,
    dtype=torch.bfloat16,
    window=0,
):
    q, cache, table, seq_lens, starts = prefill_case(
        query_lens, seq_lens, kv_heads, group, head_dim, block_size, dtype, seed=group + head_dim
    )
    reqs = torch.arange(len(query_lens)) if reqs is None else torch.tensor(reqs)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    assert kernels.paged_prefill(out, q, cache, table, seq_lens, starts, reqs, scale, window)
    expected = reference(q, cache, table, seq_lens, starts, reqs, scale, window)
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for r in reqs.tolist():
        written[int(starts[r]) : int(starts[r + 1])] = True
    torch.testing.assert_close(out[written].double(), expected[written], **TOLERANCE[dtype])
    assert out[~written].eq(7.0).all(), "rows of other requests must not be written"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_fresh_prompts_match_reference(kernels, head_dim, group, block_size):
    lens = [1, 2, 15, 16, 17, 33, 100, 300]
    check(kernels, lens, lens, 2, group, head_dim, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_float32_and_fp16(kernels, dtype, group):
    """The AVX2 kernel's other dtypes (AMX builds hand them to it too)."""
    lens = [1, 7, 9, 16, 17, 40, 130]
    check(kernels, lens, lens, 2, group, 64, 16, dtype=dtype)
    check(kernels, [5, 40, 1, 17], [100, 41, 77, 300], 1, group, 128, 8, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_windows(kernels, dtype, window):
    """Windows shorter and longer than a tile, over fresh prompts and cached prefixes."""
    check(kernels, [3, 40, 70, 9], [3, 40, 200, 90], 2, 3, 64, 16, dtype=dtype, window=window)


@pytest.mark.parametrize("block_size", [16, 32])
def test_cached_prefixes_and_chunks(kernels, block_size):
    """Query rows at the end of longer contexts: prefix hits and later chunks of a prompt."""
    check(kernels, [5, 40, 1, 64, 17], [100, 41, 77, 64, 500], 3, 3, 64, block_size)


def test_only_the_given_requests_are_written(kernels):
    check(kernels, [3, 20, 2, 30], [3, 50, 9, 30], 1, 4, 64, 16, reqs=[1, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompt(kernels, dtype):
    check(kernels, [2048], [2100], 2, 2, 128, 16, dtype=dtype)


def test_bad_inputs_are_refused(kernels):
    q, cache, table, seq_lens, starts = prefill_case([4], [4], 1, 2, 64, 16, torch.bfloat16)
    out, reqs = torch.zeros_like(q), torch.tensor([0])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.paged_prefill(out.float(), q.float(), cache, table, seq_lens, starts, reqs, 1.0, 0)
    with pytest.raises(RuntimeError, match="more queries than context"):
        kernels.paged_prefill(out, q, cache, table, seq_lens - 1, starts, reqs, 1.0, 0)


@pytest.mark.parametrize("isa", kernel_isas())
def test_what_no_kernel_takes_is_declined(isa):
    """Head sizes other than 64/128 and float64 queries on every build, and everything on a
    build below AVX2: False, and nothing written."""
    kernels = load_cpu_attention(KernelSet(cpu=True, isa=isa))
    declined = [(32, torch.bfloat16), (96, torch.float32), (64, torch.float64)]
    if not KernelSet(isa=isa).has("avx2"):
        declined += [(64, torch.float32), (128, torch.bfloat16)]
    gen = torch.Generator().manual_seed(0)
    for head_dim, dtype in declined:
        cache, table = random_pages([9], 2, head_dim, 16, dtype, gen, 1, 2)
        q = strided_q(9, 4, 2, head_dim, dtype, gen)
        out = torch.full_like(q, 7.0)
        starts, seq_lens = torch.tensor([0, 9], dtype=torch.int32), torch.tensor([9]).int()
        args = (out, q, cache, table, seq_lens, starts, torch.tensor([0]), 0.125, 0)
        assert not kernels.paged_prefill(*args)
        assert out.eq(7.0).all()


@pytest.mark.parametrize("isa", kernel_isas())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,window", [(64, None), (64, 5), (8, None)])
def test_the_backend_matches_the_torch_backend(isa, dtype, head_dim, window):
    """Through the CPU backend, kernel or (what it declines) torch prefill, against the
    torch backend: a cached prefix and a fresh prompt in one step."""
    kernels = load_cpu_attention(KernelSet(cpu=True, isa=isa))
    reqs = PagedRequests([40, 23], 4, 2, head_dim, 16, sliding_window=window, dtype=dtype)
    reqs.cache_prefix(0, 10)
    schedule = [(0, 10, 30), (1, 0, 23)]
    expected = reqs.run_step(TorchAttentionBackend(), schedule)
    got = reqs.run_step(CPUAttentionBackend(kernels), schedule)
    tolerance = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else {}
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
