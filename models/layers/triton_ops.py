"""The fused CUDA kernels of models/layers, in Triton: RMSNorm (with the residual add),
SiLU-and-mul, neox rotary embedding of q and k in place.

They have the functions and signatures of the C++ CPU kernels (cpu_ops.cpp), and like them
return None (False for the in-place ones), doing nothing, for tensors they do not take (the
`*_fits` functions say which they take; the layers then run their torch code). They round
to the tensor dtype where the torch code stores a tensor, computing in float32 in between;
they are not bitwise equal to it (sums reduce in another order, exp may differ in an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_rope_store import rotate

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The widest row a norm program holds in registers; wider rows run the torch code.
MAX_NORM_BLOCK = 65536
# Elements a norm program covers: rows narrower than this share a program.
_NORM_TILE = 2048
_SILU_BLOCK = 1024


def rows_fit(x: torch.Tensor) -> bool:
    """Whether the kernels take x as rows: 1 to 3 dimensions, the last one contiguous."""
    return 1 <= x.dim() <= 3 and x.stride(-1) == 1 and x.dtype in DTYPES


def norm_fits(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the norm kernels take x (and residual, outputs: `others`) with this weight."""
    if not rows_fit(x) or triton.next_power_of_2(x.shape[-1]) > MAX_NORM_BLOCK:
        return False
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or weight.stride(0) != 1:
        return False
    return all(t.shape == x.shape and t.dtype == x.dtype and rows_fit(t) for t in others)


def rotary_fits(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> bool:
    """Whether the rotary kernel takes q [T, heads * head_dim] and k [T, kv_heads * head_dim]
    (of one dtype)."""
    return head_dim % 2 == 0 and all(
        rows_fit(t)
        and t.dim() == 2
        and t.dtype == q.dtype
        and t.shape[0] == q.shape[0]
        and t.shape[1] % head_dim == 0
        for t in (q, k)
    )


def _rows1(t: torch.Tensor) -> int:
    """Rows per outer index of a 1-3 dimensional t (see `_row_strides`)."""
    return t.shape[1] if t.dim() == 3 else 1


def _row_strides(t: torch.Tensor | None) -> tuple[int, int]:
    """(s0, s1) of a 1-3 dimensional t: row r starts at (r // rows1) * s0 + (r % rows1) * s1,
    rows1 from `_rows1`. (0, 0) for None, a tensor the kernel does not read."""
    if t is None or t.dim() == 1:
        return 0, 0
    return t.stride(0), (t.stride(1) if t.dim() == 3 else 0)


def _num_rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1] if t.shape[-1] else 0


@triton.jit
def _row_offsets(rows, rows1, s0, s1):
    return (rows // rows1) * s0 + (rows % rows1) * s1


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    num_rows,
    n,
    eps,
    rows1,
    x_s0,
    x_s1,
    res_s0,
    res_s1,
    out_s0,
    out_s1,
    sum_s0,
    sum_s1,
    ADD_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < n)[None, :]
    x_at = _row_offsets(rows, rows1, x_s0, x_s1)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_at, mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        res_at = _row_offsets(rows, rows1, res_s0, res_s1)[:, None] + cols[None, :]
        residual = tl.load(residual_ptr + res_at, mask, other=0.0).to(tl.float32)
        total = (x + residual).to(dtype)
        sum_at = _row_offsets(rows, rows1, sum_s0, sum_s1)[:, None] + cols[None, :]
        tl.store(sum_ptr + sum_at, total, mask)
        x = total.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / n
    normed = (x * tl.math.rsqrt(variance + eps)[:, None]).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, cols < n, other=0.0).to(tl.float32)
    out_at = _row_offsets(rows, rows1, out_s0, out_s1)[:, None] + cols[None, :]
    tl.store(out_ptr + out_at, (weight[None, :] * normed).to(dtype), mask)


def _launch_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor | None,
) -> None:
    num_rows, n = _num_rows(x), x.shape[-1]
    if num_rows == 0:
        return
    block = triton.next_power_of_2(n)
    rows_per_program = max(1, _NORM_TILE // block)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        total if total is not None else out,
        num_rows,
        n,
        eps,
        _rows1(x),
        *_row_strides(x),
        *_row_strides(residual),
        *_row_strides(out),
        *_row_strides(total),
        ADD_RESIDUAL=residual is not None,
        ROWS=rows_per_program,
        BLOCK=block,
        num_warps=min(16, max(1, rows_per_program * block // 512)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * norm(x) in a new contiguous tensor (x: rows, see `norm_fits`)."""
    if not norm_fits(x, weight):
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    total: torch.Tensor,
) -> bool:
    """total = x + residual, out = weight * norm(total); out may be x and total may be
    residual (in place): a program reads its rows before it writes them."""
    if not norm_fits(x, weight, residual, out, total):
        return False
    _launch_norm(x, residual, weight, eps, out, total)
    return True


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(
    x_ptr, out_ptr, num_rows, d, rows1, x_s0, x_s1, out_s0, out_s1, BLOCK: tl.constexpr
):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate_ptr = x_ptr + _row_offsets(row, rows1, x_s0, x_s1)
    gate = tl.load(gate_ptr + cols, mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + d + cols, mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out_at = _row_offsets(row, rows1, out_s0, out_s1) + cols
    tl.store(out_ptr + out_at, (silu * up).to(dtype), mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x = [gate; up] along the last dimension (even; x: rows, see `rows_fit`) ->
    silu(gate) * up in a new contiguous tensor."""
    if not rows_fit(x) or x.shape[-1] % 2:
        return None
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    num_rows = _num_rows(out)
    if num_rows == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
        x, out, num_rows, d, _rows1(x), *_row_strides(x), *_row_strides(out), BLOCK=block
    )
    return out


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
) -> bool:
    """Rotates q and k (see `rotary_fits`) in place by the contiguous float32 cos/sin caches
    [max_position, head_dim / 2] at positions [T] (contiguous integers within the caches),
    one program per token: the kernel of attention/triton_rope_store.py, storing nothing."""
    if not rotary_fits(q, k, head_dim):
        return False
    heads = (-1, head_dim)
    rotate(positions, cos_cache, sin_cache, q.unflatten(1, heads), k.unflatten(1, heads))
    return True
