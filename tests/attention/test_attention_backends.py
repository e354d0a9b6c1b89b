"""Every backend, through the real Attention layer (store-KV included), against plain causal
attention over each request's whole unpaged sequence. The Triton backend runs on the GPU
when there is one, else under the interpreter; the others on the CPU."""

import random
import sys

import fake_flash_attn
import pytest
import torch
from paged_requests import PagedRequests

from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.flash_attn_backend import FlashAttentionBackend
from attention.backends.torch_backend import TorchAttentionBackend
from attention.backends.triton_backend import TritonAttentionBackend
from kernels import KernelSet

HEAD_DIM = 8
BLOCK_SIZE = 4


@pytest.fixture(params=["torch", "cpu", "triton", "flash_attn"])
def backend(request, monkeypatch):
    if request.param == "cpu":
        return CPUAttentionBackend(load_cpu_attention(KernelSet(cpu=True)))
    if request.param == "flash_attn":
        monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)
        return FlashAttentionBackend()
    if request.param == "triton":  # small tiles: several query tiles and key tiles per request
        return TritonAttentionBackend(prefill_block_q=4, block_n=16)
    return TorchAttentionBackend()


@pytest.fixture
def device(backend, kernel_device):
    return kernel_device if backend.name == "triton" else "cpu"


def make_requests(seq_lens, device, heads=(4, 2), sliding_window=None, dtype=torch.float32):
    num_heads, num_kv_heads = heads
    return PagedRequests(
        seq_lens,
        num_heads,
        num_kv_heads,
        HEAD_DIM,
        BLOCK_SIZE,
        sliding_window=sliding_window,
        dtype=dtype,
        device=device,
    )


def check_step(reqs, backend, schedule, num_padding=0, atol=2e-5, rtol=1e-4):
    outs = reqs.run_step(backend, schedule, num_padding)
    for (req, start, query_len), out in zip(schedule, outs, strict=True):
        if query_len:
            expected = reqs.expected(req, start, query_len).to(out.dtype)
            torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_prefill(backend, device):
    reqs = make_requests([5, 9, 13], device)
    check_step(reqs, backend, [(0, 0, 5), (1, 0, 9), (2, 0, 13)])


def test_prefill_with_cached_prefix(backend, device):
    reqs = make_requests([13, 12, 9], device)
    reqs.cache_prefix(0, 8)
    reqs.cache_prefix(1, 3)
    reqs.cache_prefix(2, 4)  # a prefix ending exactly on a block boundary
    check_step(reqs, backend, [(0, 8, 5), (1, 3, 9), (2, 4, 5)])


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_chunked_prefill_across_steps(backend, device, sliding_window):
    """Each step stores its chunk through the layer; later chunks read it back."""
    reqs = make_requests([19, 12], device, sliding_window=sliding_window)
    check_step(reqs, backend, [(0, 0, 7)])
    check_step(reqs, backend, [(1, 0, 4), (0, 7, 6)])
    check_step(reqs, backend, [(0, 13, 5), (1, 4, 7)])
    check_step(reqs, backend, [(1, 11, 1), (0, 18, 1)])


def test_decode(backend, device):
    seq_lens = [1, 6, 9, 17, 30]
    reqs = make_requests(seq_lens, device)
    for req, n in enumerate(seq_lens):
        reqs.cache_prefix(req, n - 1)
    check_step(reqs, backend, [(req, n - 1, 1) for req, n in enumerate(seq_lens)])


def test_many_decodes_of_scattered_lengths(backend, device):
    """40 decodes in shuffled length order between two prefills: the torch backend
    groups them by length (several SDPA calls), every backend must still be exact."""
    lengths = random.Random(0).sample(range(2, 90), 40)
    decodes = [(i, n - 1, 1) for i, n in enumerate(lengths)]
    prefills = [(40, 0, 7), (41, 5, 4)]
    reqs = make_requests(lengths + [7, 9], device)
    for req, start, _ in decodes + prefills:
        reqs.cache_prefix(req, start)
    schedule = [prefills[0]] + decodes[:20] + [prefills[1]] + decodes[20:]
    check_step(reqs, backend, schedule)


def mixed_schedule(reqs, order: str):
    """Decodes (one of a 1-token prompt), a fresh prompt, a cached-prefix prefill and a
    late chunk, decode-first or interleaved; then a zero-token padding request."""
    decodes = [(0, 8, 1), (1, 20, 1), (2, 0, 1)]
    prefills = [(3, 0, 9), (4, 6, 5), (5, 12, 7)]
    for req, start, _ in decodes + prefills:
        reqs.cache_prefix(req, start)
    if order == "decode_first":
        entries = decodes + prefills
    else:
        entries = [prefills[1], decodes[0], prefills[0], decodes[2], decodes[1], prefills[2]]
    return entries + [(6, 0, 0)]


@pytest.mark.parametrize("order", ["decode_first", "interleaved"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_mixed_batch(backend, device, order, heads, sliding_window):
    reqs = make_requests([9, 21, 1, 9, 11, 19, 3], device, heads, sliding_window)
    check_step(reqs, backend, mixed_schedule(reqs, order), num_padding=3)


def test_sliding_window_start_at_every_offset(backend, device):
    """Window starts at every offset within a page and a key tile: decodes of seq_len
    20..37 and 3-token chunks after 13..29 cached tokens, window 5."""
    decodes = [(i, n - 1, 1) for i, n in enumerate(range(20, 38))]
    prefills = [(len(decodes) + i, n, 3) for i, n in enumerate(range(13, 30))]
    seq_lens = [start + n for _, start, n in decodes + prefills]
    reqs = make_requests(seq_lens, device, sliding_window=5)
    for req, start, _ in decodes + prefills:
        reqs.cache_prefix(req, start)
    check_step(reqs, backend, decodes + prefills)


@pytest.mark.parametrize("order", ["decode_first", "interleaved"])
def test_matches_torch_backend(backend, device, order):
    reqs = make_requests([9, 21, 1, 9, 11, 19, 3], device, sliding_window=6)
    schedule = mixed_schedule(reqs, order)
    outs = reqs.run_step(backend, schedule, num_padding=2)
    ref = reqs.run_step(TorchAttentionBackend(), schedule, num_padding=2)
    for out, expected in zip(outs, ref, strict=True):
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "name, dtype",
    [("torch", torch.bfloat16), ("flash_attn", torch.bfloat16), ("triton", torch.float16)],
)  # the Triton interpreter's tl.dot mishandles bf16
def test_half_precision(name, dtype, monkeypatch, kernel_device):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)
    device = kernel_device if name == "triton" else "cpu"
    backends = {
        "torch": TorchAttentionBackend,
        "triton": TritonAttentionBackend,
        "flash_attn": FlashAttentionBackend,
    }
    reqs = make_requests([9, 21, 1, 9, 11, 19, 3], device, dtype=dtype, sliding_window=7)
    schedule = mixed_schedule(reqs, "interleaved")
    check_step(reqs, backends[name](), schedule, atol=2e-2, rtol=2e-2)
