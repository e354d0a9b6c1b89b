"""Paged attention with this project's own Triton kernels."""

from attention.backends.base import AttentionBackend
from attention.backends.triton_kernels import paged_attention
from attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Launches the decode kernel over the decodes and the prefill kernel over the
    prefills (fresh prompts, cached prefixes and chunks alike); each reads the step's
    rows of q and the context from the paged cache, in any request order."""

    name = "triton"
    # The decode launch grid is (padded batch, 1, kv heads); the kernel reads seq_lens,
    # query_start_loc and block_table from the device.
    cudagraph_support = True

    def __init__(self, prefill_block_q: int = 16, block_n: int = 32) -> None:
        self.prefill_block_q = prefill_block_q
        self.block_n = block_n

    def attend(self, layer, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        split = md.split
        common = dict(
            q=q,
            out=out,
            kv_cache=kv_cache,
            block_table=md.block_table,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
            block_n=self.block_n,
        )
        if split.num_decodes:
            paged_attention(req_ids=split.decode_reqs, max_query_len=1, block_q=1, **common)
        if split.num_prefills:
            paged_attention(
                req_ids=split.prefill_reqs,
                max_query_len=split.max_prefill_query_len,
                block_q=self.prefill_block_q,
                **common,
            )
