"""A torch stand-in for the two flash-attn 2 functions the flash_attn backend calls.

Written from the documented semantics in flash_attn_interface.py: q/k/v shapes, paged
K/V ((num_blocks, page_block_size, nheads_k, headdim) with a block_table), MQA/GQA by
head groups, a causal mask aligned to the bottom-right corner, and window_size=(left,
right) letting query i see keys [i + sk - sq - left, i + sk - sq + right]. Rows with
no visible key give zeros. The CUDA build's limits (fp16/bf16 only, page sizes that
are multiples of 256) are not modelled: the selector enforces them.
"""

import torch


def _attend(q, k, v, scale, causal, window_size):
    """q [sq, h, d], k/v [sk, hk, d] -> [sq, h, d], in float32 math."""
    sq, sk = q.shape[0], k.shape[0]
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _paged(cache, block_row, seqlen):
    """The first seqlen tokens of one sequence of a paged cache."""
    pos = torch.arange(seqlen)
    page = cache.shape[1]
    return cache[block_row.long()[pos // page], pos % page]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    block_table=None,
):
    assert dropout_p == 0.0
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        if block_table is None:
            kb, vb = k[k0:k1], v[k0:k1]
        else:
            assert block_table.dtype == torch.int32
            kb, vb = _paged(k, block_table[b], k1 - k0), _paged(v, block_table[b], k1 - k0)
        out[q0:q1] = _attend(q[q0:q1], kb, vb, scale, causal, window_size)
    return out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
):
    assert block_table is not None, "only the paged form is modelled"
    assert cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        kb, vb = _paged(k_cache, block_table[b], n), _paged(v_cache, block_table[b], n)
        out[b] = _attend(q[b], kb, vb, scale, causal, window_size)
    return out
