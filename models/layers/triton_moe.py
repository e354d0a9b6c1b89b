"""Fused mixture-of-experts MLP in Triton for CUDA tensors: every token's k routed experts,

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))

with e = topk_ids[t, j]; an id < 0 names an expert held by another rank (expert parallelism)
and contributes nothing. A (token, slot) pair p = t * k + j is one row of the grouped GEMMs.

1. `moe_align` (torch ops, no host sync, no loop over experts) sorts the pairs by expert and
   pads each expert's group to a multiple of BLOCK_M, so that every block of BLOCK_M rows
   belongs to one expert (layout in its docstring).
2. `_gate_up_kernel`, one launch, program = (row block, column block of I): the block's
   x rows (gathered through the sorted pair ids) times the gate and the up rows of its
   expert's w13, SiLU-and-mul fused, into act[p] ([T * k, I]).
3. `_down_kernel`, program = (row block, column block of H): act[p] @ w2[e]^T times the
   pair's routing weight, into out[p] ([T * k, H], zeroed: pairs of no local expert stay 0).
4. torch sums the k slots of each token.

Padding rows and blocks past the padded count or of no expert write nothing. Dots
accumulate in float32 (float32 inputs get exact "ieee" dots, not tf32). Where an MLP of
torch ops in the dtype would round, so do the kernels: gate and up, silu(gate), their
product, and each slot's output row; torch sums the slots in float32 and rounds once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The interpreter's tl.dot multiplies the raw bits of bfloat16: there the kernels dot
# float32 copies of the tiles (exact products, as a bfloat16 dot into float32 has).
INTERPRETED = bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class Tiles:
    block_m: int  # pair rows per block (one expert per block); tl.dot needs >= 16
    block_n: int  # output columns per program (of I in the gate-up kernel, of H in the down)
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


# (largest T, 16-bit tiles, float32 tiles), the first row with T <= largest T taken.
# Decode: few pairs per expert, so the smallest BLOCK_M (least padding) and narrow columns
# for more programs. Prefill: each expert gets many rows, so taller blocks reuse each
# weight tile across more rows. float32 dots run on FMA units and get shallower K steps.
# The gate-up kernel holds two accumulators, hence BLOCK_N at most 64.
TILES: tuple[tuple[float, Tiles, Tiles], ...] = (
    (32, Tiles(16, 64, 64, 4, 3), Tiles(16, 64, 32, 4, 2)),
    (512, Tiles(32, 64, 64, 4, 3), Tiles(32, 64, 32, 4, 2)),
    (float("inf"), Tiles(64, 64, 64, 8, 3), Tiles(64, 64, 32, 8, 2)),
)


def tiles_for(num_tokens: int, dtype: torch.dtype) -> Tiles:
    """The tiles of TILES for T tokens of `dtype`."""
    for largest, half, single in TILES:
        if num_tokens <= largest:
            return single if dtype == torch.float32 else half
    raise AssertionError("the last row of TILES takes every T")


class Alignment(NamedTuple):
    """The pairs grouped by expert in blocks of block_m (see `moe_align`)."""

    sorted_ids: torch.Tensor  # int32 [num_blocks * block_m]: pair ids, num_pairs = padding
    expert_ids: torch.Tensor  # int32 [num_blocks]: each block's expert, -1 past the groups
    num_padded: torch.Tensor  # int32 [1]: rows in the expert groups (a multiple of block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Groups the pairs p = t * k + j of topk_ids [T, k] (ids in [0, num_experts), or < 0
    for none) by expert, for grouped GEMMs in blocks of block_m rows.

    The groups lie in expert order, expert e's at padded_start[e], the sum of the earlier
    groups' sizes each rounded up to a multiple of block_m (an expert without pairs has an
    empty group). A group holds its pairs in increasing p, then the padding: P = T * k, an id
    past the last pair. Pairs of ids < 0 appear nowhere. expert_ids[b] is the expert of rows
    [b * block_m, (b + 1) * block_m), -1 for the blocks past num_padded. E.g. block_m 4,
    topk_ids [[1, 0], [1, -1], [1, 0]]: sorted_ids 1 5 P P | 0 2 4 P | P P P P ...,
    expert_ids 0 1 -1 ..., num_padded 8.

    The tensors' sizes depend only on the shapes (P valid pairs, each of at most
    min(E, P) groups padded by at most block_m - 1), so nothing waits for the device.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = triton.cdiv(capacity, block_m)
    # Pairs of no local expert take key E: they sort last, into a group that is dropped.
    key = torch.where(flat >= 0, flat.long(), num_experts)
    # (not bincount: on CUDA it waits for the device to size its output)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    group_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)  # pair ids by expert, then by p
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - group_start[sorted_key]
    # The dropped pairs all land on one extra slot past the end, cut off below.
    dest = torch.where(
        sorted_key < num_experts, padded_start[sorted_key] + rank, num_blocks * block_m
    )
    sorted_ids = torch.full(
        (num_blocks * block_m + 1,), num_pairs, dtype=torch.int32, device=device
    )
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    # The first expert whose group ends past the block's start (empty groups end at it).
    expert = torch.searchsorted(padded_end[:num_experts], block_start, right=True)
    expert_ids = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    num_padded = padded_end[num_experts - 1 : num_experts].to(torch.int32)
    return Alignment(sorted_ids[:-1], expert_ids, num_padded)


@triton.jit
def block_rows(sorted_ptr, expert_ptr, num_padded_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """(expert, pair ids, which of them are pairs) of this program's row block; expert -1
    for a block past the groups."""
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    expert = tl.where(block * BLOCK_M < tl.load(num_padded_ptr), expert, -1)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pairs, pairs < num_pairs


@triton.jit
def store_silu_mul(act_ptr, gate, up, pairs, cols, act_stride, row_ok, col_ok):
    """act[pairs, cols] = silu(gate) * up from float32 accumulators, rounded to act's dtype
    where a torch MLP in that dtype rounds: gate, up, silu(gate) and the product."""
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = silu * up.to(dtype).to(tl.float32)
    act_at = pairs[:, None] * act_stride + cols[None, :]
    tl.store(act_ptr + act_at, act.to(dtype), row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    sorted_ptr,
    expert_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    hidden,
    inter,
    x_stride,
    w_stride_e,
    w_stride_n,
    act_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    expert, pairs, row_ok = block_rows(sorted_ptr, expert_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    x_rows = x_ptr + (pairs // top_k) * x_stride
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_cols = w_ptr + expert.to(tl.int64) * w_stride_e + cols.to(tl.int64) * w_stride_n
    up_cols = gate_cols + inter * w_stride_n
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_rows[:, None] + ks[None, :], row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_cols[None, :] + ks[:, None], w_mask, other=0.0)
        w_up = tl.load(up_cols[None, :] + ks[:, None], w_mask, other=0.0)
        if DOT_F32:
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        gate = tl.dot(a, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
    store_silu_mul(act_ptr, gate, up, pairs, cols, act_stride, row_ok, col_ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    num_padded_ptr,
    num_pairs,
    hidden,
    inter,
    act_stride,
    w_stride_e,
    w_stride_n,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    expert, pairs, row_ok = block_rows(sorted_ptr, expert_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    act_rows = act_ptr + pairs * act_stride
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_cols = w_ptr + expert.to(tl.int64) * w_stride_e + cols.to(tl.int64) * w_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_rows[:, None] + ks[None, :], row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols[None, :] + ks[:, None], k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc *= tl.load(weights_ptr + pairs, row_ok, other=0.0)[:, None]
    out_at = pairs[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), row_ok[:, None] & col_ok[None, :])


def triton_moe_takes(x: torch.Tensor) -> bool:
    """Whether `fused_experts_triton` takes these activations (else the torch code runs)."""
    return x.is_cuda and x.dim() == 2 and x.dtype in DTYPES


def _check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    num_tokens, hidden = x.shape
    experts, inter = w2.shape[0], w2.shape[2]
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13, w2 must share one of {DTYPES}: {x.dtype} {w13.dtype} {w2.dtype}")
    if w13.shape != (experts, 2 * inter, hidden) or w2.shape != (experts, hidden, inter):
        raise ValueError(f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit H = {hidden}")
    if ids.dim() != 2 or ids.shape[0] != num_tokens or weights.shape != ids.shape:
        raise ValueError(f"topk {tuple(weights.shape)} {tuple(ids.shape)} != [{num_tokens}, k]")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the rows of w13 and w2 must be contiguous")


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x [T, H] through the experts: w13 [E, 2 * I, H] (gate rows, then up rows), w2
    [E, H, I], all of one dtype; topk_weights [T, k] (float32) and topk_ids [T, k] (int64,
    < 0 for no local expert). Returns [T, H] in x's dtype. `tiles` overrides TILES."""
    _check(x, w13, w2, topk_weights, topk_ids)
    experts, inter, hidden, top_k = w2.shape[0], w2.shape[2], x.shape[1], topk_ids.shape[1]

    def gate_up(grid, x, act, alignment, meta):
        _gate_up_kernel[grid](
            x, w13, act, *alignment, top_k, hidden, inter,
            x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            BLOCK_K=meta["tiles"].block_k, **meta["launch"],
        )  # fmt: skip

    def down(grid, act, weights, out, alignment, meta):
        _down_kernel[grid](
            act, w2, weights, out, *alignment, hidden, inter,
            act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            BLOCK_K=meta["tiles"].block_k, **meta["launch"],
        )  # fmt: skip

    return launch_experts(x, topk_weights, topk_ids, experts, inter, tiles, gate_up, down)


def launch_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: int,
    inter: int,
    tiles: Tiles | None,
    gate_up: Callable[..., None],
    down: Callable[..., None],
) -> torch.Tensor:
    """The frame of the two launches, whatever the experts' weights: the pairs aligned by
    expert, act [T * k, I] and out [T * k, H] allocated, gate_up(grid, x, act, alignment,
    meta) over (row blocks, column blocks of I), down(grid, act, weights, out, alignment,
    meta) over (row blocks, column blocks of H), the slots summed in float32. meta:
    "tiles", and "launch", the keyword arguments both kernels take (block sizes but K, dot
    settings, warps, stages)."""
    num_tokens, hidden = x.shape
    num_pairs = num_tokens * topk_ids.shape[1]
    if num_pairs == 0 or experts == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiles = tiles or tiles_for(num_tokens, x.dtype)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, experts, tiles.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    out = torch.zeros((num_pairs, hidden), dtype=x.dtype, device=x.device)
    launch = dict(
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        DOT_F32=INTERPRETED and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    meta = {"tiles": tiles, "launch": launch}
    blocks = expert_ids.shape[0]
    alignment = (sorted_ids, expert_ids, num_padded, num_pairs)
    gate_up((blocks, triton.cdiv(inter, tiles.block_n)), x, act, alignment, meta)
    down((blocks, triton.cdiv(hidden, tiles.block_n)), act, weights, out, alignment, meta)
    return out.view(num_tokens, -1, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
