"""The C++ paged decode kernel (attention/backends/cpu_attn.cpp) against attention computed
in float64 over each request's context gathered by hand from random page tables, built for
each of its paths' ISAs that this CPU has."""

import pytest
import torch
from paged_requests import random_pages, strided_q

from attention import get_attn_backend
from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from kernels import KernelSet, probe_isa
from kernels.isa import includes


@pytest.fixture(scope="module", params=["amx", "avx512_bf16", "avx2", "generic"])
def kernels(request):
    """The kernels built for AMX (bf16 decodes on tiles), AVX512-BF16 (fp8 pages widened
    to bf16 for the AVX2 path), AVX2 (float32, bf16 and fp16 pages of head sizes 64k, by
    hand) and the baseline (the generic path, which every dtype and head size can take)."""
    native = probe_isa()
    if not includes(native, request.param):
        pytest.skip(f"this CPU has no {request.param} (it has {native})")
    module = load_cpu_attention(KernelSet(cpu=True, isa=request.param))
    assert module is not None, "the C++ kernels must build wherever the tests run (g++)"
    return module


def reference(q, cache, table, seq_lens, reqs, rows, scale, window):
    """out[rows[i]] = softmax(q . k) v over the visible positions of request reqs[i]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size, group = cache.shape[2], q.shape[1] // cache.shape[3]
    for req, row in zip(reqs.tolist(), rows.tolist(), strict=True):
        seq_len = int(seq_lens[req])
        first = 0 if window is None else max(0, seq_len - window)
        pos = torch.arange(first, seq_len)
        slots = table[req, pos // block_size].long(), pos % block_size
        k = cache[0][slots].double().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = cache[1][slots].double().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[row].double(), k) * scale).softmax(-1)
        out[row] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def decode_case(seq_lens, kv_heads, group, head_dim, block_size, dtype, seed=0, extra_rows=3):
    """Random pages for each request, and one decode row per request at a scattered row of a
    strided q (as a view of a fused QKV output)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    cache, table = random_pages(seq_lens, kv_heads, head_dim, block_size, dtype, gen, 2, 5)
    num_rows = num_reqs + extra_rows
    q = strided_q(num_rows, kv_heads * group, kv_heads, head_dim, dtype, gen)
    reqs = torch.randperm(num_reqs, generator=gen)
    rows = torch.randperm(num_rows, generator=gen)[:num_reqs]
    return q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), reqs, rows


TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def check(kernels, seq_lens, kv_heads, group, head_dim, block_size, dtype, window=None, seed=0):
    q, cache, table, seq_lens, reqs, rows = decode_case(
        seq_lens, kv_heads, group, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, 7.0)
    kernels.paged_decode(out, q, cache, table, seq_lens, reqs, rows, scale, window or 0)
    expected = reference(q, cache, table, seq_lens, reqs, rows, scale, window)
    torch.testing.assert_close(out[rows].double(), expected[rows], **TOLERANCE[dtype])
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert out[untouched].eq(7.0).all(), "rows that are not decodes must not be written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(kernels, dtype, head_dim, group, block_size):
    seq_lens = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size, 77, 500]
    check(kernels, seq_lens, 2, group, head_dim, block_size, dtype, seed=group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_contexts(kernels, dtype):
    check(kernels, [4096, 4095, 2049, 1], 2, 3, 64, 16, dtype)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliding_window(kernels, window, dtype):
    check(kernels, [1, 4, 5, 17, 33, 99, 100, 101, 300], 2, 4, 64, 16, dtype, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_head_dims_and_block_sizes(kernels, dtype):
    """Head sizes with no specialised path, and small blocks (runs shorter than 16)."""
    for head_dim, block_size in [(32, 4), (80, 8), (96, 16), (256, 16)]:
        check(kernels, [1, 9, 40, 130], 1, 2, head_dim, block_size, dtype)


def test_threads_give_the_same_result(kernels):
    """One thread takes whole requests, two take (request, KV head) items: same result."""
    q, cache, table, seq_lens, reqs, rows = decode_case([300] * 12, 3, 3, 64, 16, torch.bfloat16)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = torch.zeros_like(q)
        kernels.paged_decode(out, q, cache, table, seq_lens, reqs, rows, 0.125, 0)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv_heads, group", [(8, 4), (2, 16), (1, 32)])
def test_many_query_heads_per_request(kernels, kv_heads, group):
    """Enough requests for whole-request items; the AMX path splits a request's query heads
    into items of at most 16, and takes none when one KV head has more than 16."""
    check(kernels, [1, 17, 40, 130] * 5, kv_heads, group, 64, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size, window", [(8, None), (16, None), (16, 37), (32, 100)])
def test_whole_request_items(kernels, dtype, head_dim, block_size, window):
    """At least 8 decodes per thread: an item is a whole request, every KV head in one pass
    (contexts that end inside a chunk of 8, on a block's last position, and long ones)."""
    seq_lens = [1, 7, 8, 9, block_size, block_size + 1, 63, 64, 65, 300, 517, 1000] * 2
    check(kernels, seq_lens, 3, 3, head_dim, block_size, dtype, window=window, seed=head_dim)


def test_amx_path_is_built_for_amx_only(kernels):
    """has_amx_path: built for AMX (and the kernel granted the tiles)."""
    assert kernels.has_amx_path() == kernels.__name__.endswith("_amx.attention")


def test_bad_inputs_are_refused(kernels):
    q, cache, table, seq_lens, reqs, rows = decode_case([10], 1, 2, 64, 16, torch.float32)
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.paged_decode(out, q.bfloat16(), cache, table, seq_lens, reqs, rows, 1.0, 0)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_decode(out, q, cache, table.long(), seq_lens, reqs, rows, 1.0, 0)


def test_auto_picks_the_kernels_and_falls_back_without_them(kernels):
    on = KernelSet(cpu=True)
    assert isinstance(get_attn_backend("auto", "cpu", kernels=on), CPUAttentionBackend)
    assert isinstance(get_attn_backend("cpu", "cpu", kernels=on), CPUAttentionBackend)
    off = KernelSet()  # SPLITSERVE_CPU_KERNELS=0
    assert isinstance(get_attn_backend("auto", "cpu", kernels=off), TorchAttentionBackend)
    with pytest.raises(RuntimeError, match="could not be built"):
        get_attn_backend("cpu", "cpu", kernels=off)
