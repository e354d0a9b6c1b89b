"""Sort-free sampling of CUDA logits in Triton: greedy, temperature, top-k, top-p and min-p,
one program per row, with the signature and meaning of the C++ CPU kernel (sampler_cpu.cpp).

A random row with weights w_i = exp((x_i - max) / T) for its kept tokens (0 for the others)
samples the first token whose cumulative weight exceeds u * sum(w), u being the row's
uniform draw (made by the caller). Filters, each a threshold so that ties stay together:
top-k keeps x >= the k-th largest logit; top-p then keeps w >= the largest t whose kept mass
sum(w >= t) reaches p * sum(w) (the most likely token is always kept); min-p then keeps
w >= min_p (the max's weight is 1). Both thresholds are found without a sort, by a search
over the order keys of the values (int32s in the order of the floats): each step is one
pass over the row measuring what a candidate key keeps. The row is read in tiles, in place,
and everything is computed in float32.
"""

import torch
import triton
import triton.language as tl

TAKES_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TILE = 2048
# Order keys of -inf (int32(0xFF800000) ^ 0x7FFFFFFF) and of 1.0.
_NEG_INF_KEY = tl.constexpr(-(2**31) + 2**23 - 1)
_ONE_KEY = tl.constexpr(0x3F800000)


@triton.jit
def _order_key(value):
    """float32 -> int32 in the order of the floats (the map is its own inverse)."""
    bits = value.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _load_tile(row_ptr, offsets, vocab_size):
    x = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf"))
    return x.to(tl.float32)


@triton.jit
def _weights(x, row_max, inv_temperature, kth_largest):
    """The top-k-filtered weights of a tile (0 off the row: its logits load as -inf)."""
    return tl.where(x >= kth_largest, tl.exp((x - row_max) * inv_temperature), 0.0)


@triton.jit
def _threshold_key(
    row_ptr,
    vocab_size,
    target,
    lo,
    hi,
    row_max,
    inv_temperature,
    kth_largest,
    BY_MASS: tl.constexpr,
    TILE: tl.constexpr,
):
    """The largest key K with measure(values of key >= K) >= target, lo qualifying and hi not.
    BY_MASS: the values are the weights and the measure their sum; else the values are the
    logits and the measure their count (target k: K is the k-th largest logit's key). Each
    step moves lo up to the smallest value it keeps, or hi down past the largest it drops,
    so both stay on the row's values; a count of exactly k ends the search early."""
    offsets = tl.arange(0, TILE)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        measure = tl.zeros([], tl.float32)
        lowest_kept = tl.full([], float("inf"), tl.float32)
        highest_dropped = tl.full([], float("-inf"), tl.float32)
        for start in range(0, vocab_size, TILE):
            values = _load_tile(row_ptr, start + offsets, vocab_size)
            if BY_MASS:
                values = _weights(values, row_max, inv_temperature, kth_largest)
            kept = _order_key(values).to(tl.int64) >= mid
            if BY_MASS:
                measure += tl.sum(tl.where(kept, values, 0.0))
            else:
                measure += tl.sum(kept.to(tl.float32))
            lowest_kept = tl.minimum(lowest_kept, tl.min(tl.where(kept, values, float("inf"))))
            highest_dropped = tl.maximum(
                highest_dropped, tl.max(tl.where(kept, float("-inf"), values))
            )
        if measure >= target:
            lo = _order_key(lowest_kept).to(tl.int64)
            if not BY_MASS:
                hi = tl.where(measure == target, lo + 1, hi)
        else:
            hi = _order_key(highest_dropped).to(tl.int64) + 1
    return lo


@triton.jit
def _kept_weights(row_ptr, offsets, vocab_size, row_max, inv_temperature, kth_largest, min_w):
    x = _load_tile(row_ptr, offsets, vocab_size)
    w = _weights(x, row_max, inv_temperature, kth_largest)
    return tl.where(w >= min_w, w, 0.0)


@triton.jit
def _sample_row(
    row,
    row_ptr,
    vocab_size,
    row_max,
    temperature,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    u_ptr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    TILE: tl.constexpr,
):
    """The sampled token of a random row, or -1 when its kept weights sum to nothing."""
    offsets = tl.arange(0, TILE)
    inv_temperature = 1.0 / temperature
    kth_largest = tl.full([], float("-inf"), tl.float32)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < vocab_size):
            lo = tl.full([], _NEG_INF_KEY, tl.int64)
            hi = _order_key(row_max).to(tl.int64) + 1
            key = _threshold_key(
                row_ptr,
                vocab_size,
                k.to(tl.float32),
                lo,
                hi,
                row_max,
                inv_temperature,
                kth_largest,
                BY_MASS=False,
                TILE=TILE,
            )
            kth_largest = _key_value(key)
    min_w = tl.zeros([], tl.float32)
    if HAS_MIN_P:
        min_w = tl.load(min_p_ptr + row).to(tl.float32)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        if top_p < 1.0:
            total = tl.zeros([], tl.float32)
            for start in range(0, vocab_size, TILE):
                x = _load_tile(row_ptr, start + offsets, vocab_size)
                total += tl.sum(_weights(x, row_max, inv_temperature, kth_largest))
            # Key 1 (the smallest positive float) keeps every positive weight; the max's
            # weight is 1, so nothing keeps more than key(1.0).
            lo = tl.full([], 1, tl.int64)
            hi = tl.full([], _ONE_KEY + 1, tl.int64)
            key = _threshold_key(
                row_ptr,
                vocab_size,
                top_p * total,
                lo,
                hi,
                row_max,
                inv_temperature,
                kth_largest,
                BY_MASS=True,
                TILE=TILE,
            )
            min_w = tl.maximum(min_w, _key_value(key))
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, TILE):
        w = _kept_weights(
            row_ptr, start + offsets, vocab_size, row_max, inv_temperature, kth_largest, min_w
        )
        total += tl.sum(w)
    target = tl.load(u_ptr + row).to(tl.float32) * total
    # Walk the tiles until the cumulative weight exceeds the target; were rounding to leave
    # it short, the last kept token is taken.
    token = tl.full([], -1, tl.int64)
    last_kept = tl.full([], -1, tl.int64)
    cumulative = tl.zeros([], tl.float32)
    start = tl.zeros([], tl.int64)
    while (start < vocab_size) & (token < 0) & (total > 0.0):
        w = _kept_weights(
            row_ptr, start + offsets, vocab_size, row_max, inv_temperature, kth_largest, min_w
        )
        crossed = (tl.cumsum(w, 0) + cumulative > target) & (w > 0.0)
        first = tl.min(tl.where(crossed, offsets, TILE))
        token = tl.where(first < TILE, start + first, -1)
        last_kept = tl.maximum(last_kept, start + tl.max(tl.where(w > 0.0, offsets, -1)))
        cumulative += tl.sum(w)
        start += TILE
    return tl.where(token >= 0, token, last_kept)


@triton.jit
def _sample_kernel(
    logits_ptr,
    row_stride,
    vocab_size,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    u_ptr,
    out_ptr,
    greedy_below,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    offsets = tl.arange(0, TILE)
    # Pass 1: the max and the first index of it (torch.argmax's; 0 for a row of -inf).
    row_max = tl.full([], float("-inf"), tl.float32)
    argmax = tl.zeros([], tl.int64)
    for start in range(0, vocab_size, TILE):
        x = _load_tile(row_ptr, start + offsets, vocab_size)
        tile_max = tl.max(x)
        first = tl.min(tl.where(x == tile_max, offsets, TILE))
        argmax = tl.where(tile_max > row_max, start + first, argmax)
        row_max = tl.maximum(row_max, tile_max)
    token = argmax
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if (temperature >= greedy_below) & (row_max > float("-inf")):
        sampled = _sample_row(
            row,
            row_ptr,
            vocab_size,
            row_max,
            temperature,
            top_k_ptr,
            top_p_ptr,
            min_p_ptr,
            u_ptr,
            HAS_TOP_K,
            HAS_TOP_P,
            HAS_MIN_P,
            TILE,
        )
        token = tl.where(sampled >= 0, sampled, argmax)
    tl.store(out_ptr + row, token)


def triton_takes(logits: torch.Tensor) -> bool:
    """Whether `sample_triton` takes these logits as they are (else the torch path samples)."""
    return logits.is_cuda and logits.dim() == 2 and logits.dtype in TAKES_DTYPES


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    u: torch.Tensor,
    greedy_below: float,
    tile: int = MAX_TILE,
) -> torch.Tensor:
    """logits [rows, vocab] (float32, bfloat16 or float16, read in place); one value per row
    in every other tensor, all on the logits' device; a None filter is off for every row,
    top_k <= 0 or top_p >= 1 for one row. Rows with temperature < greedy_below take the
    argmax. Returns the int64 token of each row."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    tile = min(triton.next_power_of_2(vocab_size), tile)
    temperature = temperature.to(torch.float32)
    unused = temperature
    _sample_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        vocab_size,
        temperature,
        unused if top_k is None else top_k.to(torch.int32),
        unused if top_p is None else top_p.to(torch.float32),
        unused if min_p is None else min_p.to(torch.float32),
        u.to(torch.float32),
        out,
        float(greedy_below),
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        TILE=tile,
        num_warps=8 if tile >= 2048 else 4,
    )
    return out
