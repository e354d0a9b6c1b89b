"""The Triton fused-MoE kernels (models/layers/triton_moe.py; on the GPU, or under
TRITON_INTERPRET=1 without one) against a float64 reference that runs each token through
each of its experts, and the alignment's block layout exactly.

The kernels round gate, up, silu(gate), their product and each slot's output to the dtype
and sum in float32; the bound is one unit of the dtype's rounding of `magnitude`, the sum
over a token's experts of |w2| @ (|w13_gate| |x| * |w13_up| |x|) + |slot output| (weighted),
which carries all of those errors (the largest seen is a third of the bound); a token of no
local expert must come out exactly 0. The interpreter rounds float32 to bfloat16 by
truncation, so bfloat16 gets two units. Shapes are tiny (the interpreter is slow): H, I =
32, 16 and 64, 48 leave partial column and K tiles; SMALL_TILES several of them.
"""

from __future__ import annotations

import pytest
import torch

from models.layers.triton_moe import (
    fused_experts_triton,
    moe_align,
    tiles_for,
    triton_moe_takes,
)
from tests.models.moe_reference import SMALL_TILES, reference, routing

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def check(num_tokens, top_k, experts, hidden, inter, dtype, device, tiles=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13, w2 = random_experts(experts, hidden, inter, dtype, seed)
    weights, ids = routing(num_tokens, top_k, experts, seed)
    on = [t.to(device) for t in (x, w13, w2, weights, ids)]
    out = fused_experts_triton(*on, tiles=tiles)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden) and out.device == on[0].device
    expected, magnitude = reference(x, w13, w2, weights, ids)
    eps = torch.finfo(dtype).eps * (2 if dtype == torch.bfloat16 else 1)
    bound = eps * magnitude + 1e-30
    error = (out.cpu().double() - expected).abs()
    assert (error <= bound).all(), f"{(error / bound).max():.2f} of the bound"
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("experts, hidden, inter", [(4, 32, 16), (8, 64, 48)], ids=str)
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_matches_reference(kernel_device, num_tokens, top_k, experts, hidden, inter, dtype):
    seed = num_tokens * 100 + top_k * 10 + experts
    check(num_tokens, top_k, experts, hidden, inter, dtype, kernel_device, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, top_k, experts", [(5, 2, 8), (33, 4, 4)], ids=str)
def test_several_tiles_per_row_and_column(kernel_device, num_tokens, top_k, experts, dtype):
    """Several K steps and column blocks, partial last ones (K 48, I 48 by 32), and with
    33 tokens on 4 experts several row blocks per expert."""
    check(num_tokens, top_k, experts, 64, 48, dtype, kernel_device, SMALL_TILES, seed=7)


def test_no_local_expert_gives_zeros(kernel_device):
    x = torch.randn(3, 32, device=kernel_device)
    w13, w2 = (t.to(kernel_device) for t in random_experts(4, 32, 16, torch.float32, 0))
    ids = torch.full((3, 2), -1, device=kernel_device)
    weights = torch.rand(3, 2, device=kernel_device)
    assert (fused_experts_triton(x, w13, w2, weights, ids) == 0).all()
    empty = fused_experts_triton(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


def test_alignment_layout_example():
    """The example of moe_align's docstring, P = 6 the padding, E = 3 (expert 2 empty)."""
    ids = torch.tensor([[1, 0], [1, -1], [1, 0]])
    sorted_ids, expert_ids, num_padded = moe_align(ids, 3, 4)
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
    # capacity 6 pairs + 3 groups * 3 pads = 15 rows: 4 blocks
    assert sorted_ids.tolist() == [1, 5, 6, 6, 0, 2, 4, 6] + [6] * 8
    assert expert_ids.tolist() == [0, 1, -1, -1]
    assert num_padded.tolist() == [8]


@pytest.mark.parametrize("num_tokens, top_k, experts, block_m", [(33, 4, 8, 16), (7, 2, 16, 4)])
def test_alignment_layout_random(num_tokens, top_k, experts, block_m):
    """Every pair of a local expert once, in its expert's group, in order, the groups in
    expert order each padded to a multiple of block_m, the blocks' experts."""
    _, ids = routing(num_tokens, top_k, experts, seed=num_tokens)
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    sorted_ids, expert_ids, num_padded = moe_align(ids, experts, block_m)
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    rows = sorted_ids.tolist()
    start = 0
    for e in range(experts):
        pairs = [p for p in range(num_pairs) if flat[p] == e]
        size = -(-len(pairs) // block_m) * block_m
        assert rows[start : start + size] == pairs + [num_pairs] * (size - len(pairs))
        assert expert_ids[start // block_m : (start + size) // block_m].tolist() == [e] * (
            size // block_m
        )
        start += size
    assert num_padded.item() == start
    assert rows[start:] == [num_pairs] * (len(rows) - start)
    assert (expert_ids[start // block_m :] == -1).all()


def test_tiles_by_token_count():
    assert tiles_for(1, torch.bfloat16).block_m == 16
    assert tiles_for(33, torch.bfloat16).block_m == 32
    assert tiles_for(4096, torch.float16).block_m == 64
    assert tiles_for(4096, torch.float32).block_k < tiles_for(4096, torch.float16).block_k


def test_takes_cuda_rows_of_float_dtypes():
    x = torch.zeros(2, 8)
    assert not triton_moe_takes(x)
    if HAS_CUDA:
        assert triton_moe_takes(x.cuda()) and triton_moe_takes(x.cuda().half())
        assert not triton_moe_takes(x.cuda().int()) and not triton_moe_takes(x.cuda()[0])


def test_rejects_mismatched_weights():
    x = torch.zeros(2, 32)
    w13, w2 = random_experts(4, 32, 16, torch.float16, 0)
    weights, ids = routing(2, 2, 4, 0)
    with pytest.raises(ValueError, match="share"):
        fused_experts_triton(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="fit"):
        fused_experts_triton(x.half(), w13[:, :30], w2, weights, ids)
