"""The C++ AMX prefill kernel (attention/backends/cpu_prefill_amx.h) against causal
attention computed in float64 over each request's context gathered by hand from random
page tables: fresh prompts, cached prefixes and chunks, GQA groups, head sizes 64/128. And
what it declines: it says so, and the CPU backend's torch prefill runs instead."""

import pytest
import torch
from paged_requests import PagedRequests, random_pages, strided_q

from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from kernels import KernelSet


@pytest.fixture(scope="module")
def kernels():
    module = load_cpu_attention(KernelSet(cpu=True))
    assert module is not None, "the C++ kernels must build wherever the tests run (g++)"
    if not module.has_amx_path():
        pytest.skip("this CPU has no AMX: the torch prefill path runs instead")
    return module


def prefill_case(query_lens, seq_lens, kv_heads, group, head_dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    cache, table = random_pages(seq_lens, kv_heads, head_dim, block_size, bf16, gen, 1, 3)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = strided_q(int(starts[-1]), kv_heads * group, kv_heads, head_dim, bf16, gen)
    return q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


def reference(q, cache, table, seq_lens, starts, reqs, scale):
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
        scores.masked_fill_(pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def check(kernels, query_lens, seq_lens, kv_heads, group, head_dim, block_size, reqs=None):
    q, cache, table, seq_lens, starts = prefill_case(
        query_lens, seq_lens, kv_heads, group, head_dim, block_size, seed=group + head_dim
    )
    reqs = torch.arange(len(query_lens)) if reqs is None else torch.tensor(reqs)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    assert kernels.paged_prefill(out, q, cache, table, seq_lens, starts, reqs, scale, 0)
    expected = reference(q, cache, table, seq_lens, starts, reqs, scale)
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for r in reqs.tolist():
        written[int(starts[r]) : int(starts[r + 1])] = True
    # bf16 probabilities and outputs: a few units of bf16 rounding
    torch.testing.assert_close(out[written].double(), expected[written], atol=2e-2, rtol=2e-2)
    assert out[~written].eq(7.0).all(), "rows of other requests must not be written"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_fresh_prompts_match_reference(kernels, head_dim, group, block_size):
    lens = [1, 2, 15, 16, 17, 33, 100, 300]
    check(kernels, lens, lens, 2, group, head_dim, block_size)


@pytest.mark.parametrize("block_size", [16, 32])
def test_cached_prefixes_and_chunks(kernels, block_size):
    """Query rows at the end of longer contexts: prefix hits and later chunks of a prompt."""
    check(kernels, [5, 40, 1, 64, 17], [100, 41, 77, 64, 500], 3, 3, 64, block_size)


def test_only_the_given_requests_are_written(kernels):
    check(kernels, [3, 20, 2, 30], [3, 50, 9, 30], 1, 4, 64, 16, reqs=[1, 3])


def test_long_prompt(kernels):
    check(kernels, [2048], [2100], 2, 2, 128, 16)


def test_bad_inputs_are_refused(kernels):
    q, cache, table, seq_lens, starts = prefill_case([4], [4], 1, 2, 64, 16)
    out, reqs = torch.zeros_like(q), torch.tensor([0])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.paged_prefill(out.float(), q.float(), cache, table, seq_lens, starts, reqs, 1.0, 0)
    with pytest.raises(RuntimeError, match="more queries than context"):
        kernels.paged_prefill(out, q, cache, table, seq_lens - 1, starts, reqs, 1.0, 0)


def test_what_the_kernel_does_not_take_it_declines():
    """float32, a window, head_dim 32, blocks of 8: False, and nothing written. Any build
    (a CPU without AMX declines everything)."""
    kernels = load_cpu_attention(KernelSet(cpu=True))
    declined = [
        ((2, 2, 64, 16, torch.float32), 0),
        ((2, 2, 64, 16, torch.bfloat16), 5),
        ((2, 2, 32, 16, torch.bfloat16), 0),
        ((2, 2, 64, 8, torch.bfloat16), 0),
    ]
    gen = torch.Generator().manual_seed(0)
    for (kv_heads, group, head_dim, block_size, dtype), window in declined:
        cache, table = random_pages([9], kv_heads, head_dim, block_size, dtype, gen, 1, 2)
        q = strided_q(9, kv_heads * group, kv_heads, head_dim, dtype, gen)
        out = torch.full_like(q, 7.0)
        starts, seq_lens = torch.tensor([0, 9], dtype=torch.int32), torch.tensor([9]).int()
        args = (out, q, cache, table, seq_lens, starts, torch.tensor([0]), 0.125, window)
        assert not kernels.paged_prefill(*args)
        assert out.eq(7.0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 5])
def test_the_backend_prefills_what_the_kernel_declines_with_torch(dtype, window):
    """A bf16 layer without a window takes the kernel (on AMX CPUs), the others the torch
    prefill; both match the torch backend."""
    kernels = load_cpu_attention(KernelSet(cpu=True))
    reqs = PagedRequests([40, 23], 4, 2, 64, 16, sliding_window=window, dtype=dtype)
    reqs.cache_prefix(0, 10)
    schedule = [(0, 10, 30), (1, 0, 23)]
    expected = reqs.run_step(TorchAttentionBackend(), schedule)
    got = reqs.run_step(CPUAttentionBackend(kernels), schedule)
    tolerance = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else {}
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
