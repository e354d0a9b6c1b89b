"""The attention paths on 8-lane vectors built for Arm and run in an emulator
(tests/kernels/aarch64_emulator.py): decode (attention/backends/cpu_attn_vec8.h) and the
prefill tile (cpu_prefill_vec8.h), bitwise the AVX2 build's output on the same pages (the
Arm vector operations round and sum as AVX2's do), and within float32 rounding of
attention in float64, for float32, bf16 and fp16 pages, head sizes 64 and 128, GQA groups,
decode items of one KV head and of a whole request, windows and partial blocks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from attention.backends.cpu_backend import load_cpu_attention
from tests.kernels.aarch64_emulator import Aarch64Program, avx2_build, program_of

PAGE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Aarch64Program:
    return program_of(
        "neon_attention_harness.cpp", ["attention/backends"], tmp_path_factory.mktemp("neon")
    )


@pytest.fixture(scope="module")
def x86_attention():
    return avx2_build(load_cpu_attention)


def neon_decode(program, q, cache, table, seq_len, first, heads, scale) -> torch.Tensor:
    """One request's decode row through attend_vec8 in items of `heads` KV heads: the
    output row as paged_decode writes it (acc times 1 / sum, rounded to q's dtype)."""
    kv_heads, dim = cache.shape[3], cache.shape[4]
    group = q.shape[0] // kv_heads
    rows = heads * group
    program.clear()
    qf = (q.float() * np.float32(scale)).numpy()
    pages = cache.view(torch.int16) if cache.dtype != torch.float32 else cache
    at_cache, at_table = program.put(pages.numpy()), program.put(table.numpy())
    out = torch.empty(q.shape, dtype=torch.float32)
    acc_at = program.put(np.zeros((rows, dim), np.float32))
    sum_at = program.put(np.zeros(rows, np.float32))
    work = program.put(np.zeros(rows * 73 + 8, np.float32))
    cache_half = cache[0].numel()
    for kv_head in range(0, kv_heads, heads):
        q_at = program.put(qf[kv_head * group : kv_head * group + rows])
        fields = (
            0, PAGE_CODES[cache.dtype], dim, q_at, acc_at, sum_at, at_cache, at_table, first,
            seq_len, kv_head, heads, cache.shape[2], kv_heads, group, cache_half, work,
        )  # fmt: skip
        program.call(program.put(np.frombuffer(struct.pack(f"<{len(fields)}q", *fields), np.uint8)))
        acc = program.get(acc_at, np.float32, rows * dim).reshape(rows, dim)
        total = program.get(sum_at, np.float32, rows)
        mul = np.float32(1.0) / total
        out[kv_head * group : kv_head * group + rows] = torch.from_numpy(acc * mul[:, None])
    return out.to(q.dtype)


def reference(q, cache, table, seq_len, first, scale) -> torch.Tensor:
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    pos = torch.arange(first, seq_len)
    slots = table[pos // block_size].long(), pos % block_size
    group = q.shape[0] // kv_heads
    k = cache[0][slots].double().repeat_interleave(group, dim=1)
    v = cache[1][slots].double().repeat_interleave(group, dim=1)
    probs = (torch.einsum("hd,nhd->hn", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("kv_heads", "group"), [(3, 3), (2, 4), (1, 8)])
@pytest.mark.parametrize("whole", [False, True], ids=["per-kv-head", "whole-request"])
def test_neon_decode_matches_the_avx2_build_and_float64(
    program, x86_attention, dtype, head_dim, kv_heads, group, whole
):
    gen = torch.Generator().manual_seed(head_dim + 10 * group)
    block_size, seq_len, window = 16, 83, 70  # partial blocks at both ends of the window
    num_blocks = 12
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: (seq_len + 15) // 16].to(torch.int32)
    q = torch.randn(kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    heads = kv_heads if whole else 1
    for first in (0, seq_len - window):
        out = neon_decode(program, q, cache, table, seq_len, first, heads, scale)
        expected = reference(q, cache, table, seq_len, first, scale)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
        if x86_attention is None:
            continue
        # Whole-request items on x86: 8 requests a thread (tests run on one: conftest), the
        # same request 8 times; else one request, an item per KV head.
        reqs = 8 if whole else 1
        x86_out = torch.empty(reqs, kv_heads * group, head_dim, dtype=dtype)
        x86_attention.paged_decode(
            x86_out, q.expand(reqs, -1, -1).contiguous(), cache,
            table.expand(reqs, -1).contiguous(), torch.full((reqs,), seq_len, dtype=torch.int32),
            torch.arange(reqs), torch.arange(reqs), scale, seq_len - first if first else 0,
        )  # fmt: skip
        for r in range(reqs):
            assert torch.equal(x86_out[r], out)


def widened_stride(seq_len: int) -> int:
    return (seq_len + 63) // 64 * 64 + 16  # as cpu_prefill_vec8.h's


def neon_prefill(program, q, cache, table, seq_len, window, scale) -> torch.Tensor:
    """One prefill's query rows (the last q.shape[0] positions of its context) through
    prefill_tile_vec8, in tiles of 16 positions per KV head, its context widened as
    widen_for_prefill does: the rows as paged_prefill writes them."""
    block_size, kv_heads, dim = cache.shape[2], cache.shape[3], cache.shape[4]
    queries, group = q.shape[0], q.shape[1] // kv_heads
    pos = torch.arange(seq_len)
    slots = table[pos // block_size].long(), pos % block_size
    keys, values = cache[0][slots].float(), cache[1][slots].float()  # [seq_len, kv_heads, D]
    stride = widened_stride(seq_len)
    qs = (q.float() * np.float32(scale)).numpy()
    out = torch.empty(q.shape, dtype=torch.float32)
    for h in range(kv_heads):
        program.clear()
        kt = np.zeros((dim, stride), np.float32)
        kt[:, :seq_len] = keys[:, h].T.numpy()
        v = np.zeros((stride, dim), np.float32)
        v[:seq_len] = values[:, h].numpy()
        kt_at, v_at = program.put(kt), program.put(v)
        for t0 in range(0, queries, 16):
            n = min(16, queries - t0)
            rows = n * group
            q_at = program.put(np.ascontiguousarray(qs[t0 : t0 + n, h * group : (h + 1) * group]))
            o_at = program.put(np.zeros((rows, dim), np.float32))
            inv_at = program.put(np.zeros(rows, np.float32))
            s_at = program.put(np.zeros(rows * (seq_len + 32), np.float32))
            first_pos = seq_len - queries + t0
            fields = (
                1, dim, q_at, n, first_pos, window, group, kt_at, v_at, stride, o_at, inv_at, s_at,
            )  # fmt: skip
            program.call(
                program.put(np.frombuffer(struct.pack(f"<{len(fields)}q", *fields), np.uint8))
            )
            o = program.get(o_at, np.float32, rows * dim).reshape(n, group, dim)
            inv = program.get(inv_at, np.float32, rows).reshape(n, group, 1)
            out[t0 : t0 + n, h * group : (h + 1) * group] = torch.from_numpy(o * inv)
    return out.to(q.dtype)


def prefill_reference(q, cache, table, seq_len, window, scale) -> torch.Tensor:
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    queries, group = q.shape[0], q.shape[1] // kv_heads
    pos = torch.arange(seq_len)
    slots = table[pos // block_size].long(), pos % block_size
    k = cache[0][slots].double().repeat_interleave(group, dim=1)
    v = cache[1][slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    at = torch.arange(seq_len - queries, seq_len)[:, None] - pos[None, :]
    visible = (at >= 0) & ((at < window) if window else True)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("kv_heads", "group"), [(3, 3), (1, 8)])
@pytest.mark.parametrize("window", [0, 21])
def test_neon_prefill_tiles_match_the_avx2_build_and_float64(
    program, x86_attention, dtype, head_dim, kv_heads, group, window
):
    gen = torch.Generator().manual_seed(head_dim + group + window)
    block_size, seq_len, queries = 16, 45, 37  # a cached prefix of 8, tiles of 16, 16 and 5
    num_blocks = 6
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:3].to(torch.int32)
    q = torch.randn(queries, kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = neon_prefill(program, q, cache, table, seq_len, window, scale)
    expected = prefill_reference(q, cache, table, seq_len, window, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    if x86_attention is None:
        return
    x86_out = torch.empty_like(q)
    assert x86_attention.paged_prefill(
        x86_out, q, cache, table[None], torch.tensor([seq_len], dtype=torch.int32),
        torch.tensor([0, queries], dtype=torch.int32), torch.tensor([0]), scale, window,
        1.0, 1.0,
    )  # fmt: skip
    assert torch.equal(x86_out, out)
