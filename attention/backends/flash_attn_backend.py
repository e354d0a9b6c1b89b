"""Paged attention with flash-attn 2 (CUDA only)."""

import torch

from attention.backends.triton_store import TritonStoreBackend
from attention.metadata import AttentionMetadata


class FlashAttentionBackend(TritonStoreBackend):
    """Decodes through `flash_attn_with_kvcache`, prefills through
    `flash_attn_varlen_func`, both reading K/V from the paged cache by block table.

    Prefills always read the paged cache, as vLLM does, not only when a prefix was
    cached: this step's K/V are already stored there, so fresh prompts, cached prefixes
    and later chunks share one call with the right causal offset (flash-attn aligns the
    causal mask to the bottom-right, i.e. query i of a request sees keys up to
    seq_len - query_len + i). A sliding window of w tokens is window_size=(w - 1, 0).

    Upstream flash-attn 2 takes fp16/bf16 only and pages of a multiple of 256 tokens;
    the selector checks both (`supports`). K/V are stored as TritonStoreBackend stores
    them.
    """

    name = "flash_attn"
    # The decode call reads only device tensors (seq_lens, block_table) and shapes fixed
    # by the padded batch; the split is computed before capture.
    cudagraph_support = True
    block_size_multiple = 256
    dtypes = (torch.float16, torch.bfloat16)

    def __init__(self, triton_store: bool = True) -> None:
        super().__init__(triton_store)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @classmethod
    def supports(cls, block_size: int | None, dtype: torch.dtype | None) -> bool:
        block_ok = block_size is None or block_size % cls.block_size_multiple == 0
        return block_ok and (dtype is None or dtype in cls.dtypes)

    def attend(self, spec, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        split = md.split
        key_cache, value_cache = kv_cache.unbind(0)
        window = (-1, -1) if spec.sliding_window is None else (spec.sliding_window - 1, 0)
        if split.num_decodes:
            result = self._with_kvcache(
                q[split.decode_rows].unsqueeze(1),
                key_cache,
                value_cache,
                cache_seqlens=md.seq_lens[split.decode_reqs],
                block_table=md.block_table[split.decode_reqs],
                softmax_scale=spec.scale,
                causal=True,
                window_size=window,
            )
            out[split.decode_rows] = result.squeeze(1)
        if split.num_prefills:
            out[split.prefill_rows] = self._varlen(
                q[split.prefill_rows],
                key_cache,
                value_cache,
                cu_seqlens_q=split.prefill_query_start_loc,
                cu_seqlens_k=split.prefill_seq_start_loc,
                max_seqlen_q=split.max_prefill_query_len,
                max_seqlen_k=split.max_prefill_seq_len,
                softmax_scale=spec.scale,
                causal=True,
                window_size=window,
                block_table=md.block_table[split.prefill_reqs],
            )
