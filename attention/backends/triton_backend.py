"""Paged attention with this project's own Triton kernels."""

from dataclasses import dataclass

import torch
import triton

from attention.backends.triton_kernels import SplitPartials, paged_attention
from attention.backends.triton_store import TritonStoreBackend
from attention.metadata import AttentionMetadata

# About two resident programs per SM of an H100/H200 (132 SMs): a decode launch with fewer
# (request, KV head) programs than this leaves most of the GPU idle.
TARGET_DECODE_PROGRAMS = 256
MAX_DECODE_SPLITS = 64
MIN_TILES_PER_SPLIT = 4


def decode_num_splits(
    num_decodes: int,
    num_kv_heads: int,
    max_context_len: int,
    block_n: int,
    target_programs: int = TARGET_DECODE_PROGRAMS,
) -> int:
    """How many ranges a decode launch splits each request's context into (1: no split).

    Splits fill the launch up to about `target_programs` programs: as many as fit
    target_programs // (num_decodes * num_kv_heads), at most MAX_DECODE_SPLITS, and no
    more than give each split MIN_TILES_PER_SPLIT key tiles of the longest possible
    context. Splitting pays only when that is at least 2, i.e. for small batches.

    Everything here is static for a CUDA graph (the padded batch size, the block table's
    width times the block size, the model's KV heads), never one step's seq_lens: the
    kernel divides each request's actual context among the splits on the device.
    """
    programs = num_decodes * num_kv_heads
    if programs == 0:
        return 1
    splits = min(
        target_programs // programs,
        MAX_DECODE_SPLITS,
        triton.cdiv(max_context_len, block_n * MIN_TILES_PER_SPLIT),
    )
    return splits if splits >= 2 else 1


@dataclass(frozen=True)
class DecodeLaunch:
    """How the decode kernel is launched: the width of its key tiles and Triton's
    num_warps / num_stages (None: Triton's defaults). `attention_bench --triton --sweep`
    times the choices on a GPU."""

    block_n: int = 32
    num_warps: int | None = None
    num_stages: int | None = None


class TritonAttentionBackend(TritonStoreBackend):
    """Launches the decode kernel over the decodes and the prefill kernel over the
    prefills (fresh prompts, cached prefixes and chunks alike); each reads the step's
    rows of q and the context from the paged cache, in any request order. Small decode
    batches split each context over several programs (`decode_num_splits`), combining
    their partials from float32 scratch that is kept per shape and reused. K/V are stored
    as TritonStoreBackend stores them."""

    name = "triton"
    # The decode launch grid is (padded batch, splits, kv heads), the split count a function
    # of the padded batch and the block table's width; the kernel reads seq_lens,
    # query_start_loc and block_table from the device, and the scratch is allocated once
    # per shape, so a captured launch replays over the same buffers.
    cudagraph_support = True

    def __init__(
        self,
        prefill_block_q: int = 16,
        block_n: int = 32,
        target_decode_programs: int = TARGET_DECODE_PROGRAMS,
        decode: DecodeLaunch | None = None,
        triton_store: bool = True,
    ) -> None:
        super().__init__(triton_store)
        self.prefill_block_q = prefill_block_q
        self.block_n = block_n
        self.decode = decode or DecodeLaunch(block_n)
        self.target_decode_programs = target_decode_programs
        self._partials: dict[tuple, SplitPartials] = {}

    def attend(self, spec, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        split = md.split
        common = dict(
            q=q,
            out=out,
            kv_cache=kv_cache,
            block_table=md.block_table,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            scale=spec.scale,
            sliding_window=spec.sliding_window,
            k_scale=spec.k_scale,
            v_scale=spec.v_scale,
        )
        if split.num_decodes:
            partials = self._decode_partials(split.num_decodes, q, kv_cache, md.block_table)
            paged_attention(
                req_ids=split.decode_reqs,
                max_query_len=1,
                block_q=1,
                block_n=self.decode.block_n,
                partials=partials,
                num_warps=self.decode.num_warps,
                num_stages=self.decode.num_stages,
                **common,
            )
        if split.num_prefills:
            paged_attention(
                req_ids=split.prefill_reqs,
                max_query_len=split.max_prefill_query_len,
                block_q=self.prefill_block_q,
                block_n=self.block_n,
                **common,
            )

    def _decode_partials(
        self, num_decodes: int, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor
    ) -> SplitPartials | None:
        """The scratch of a split decode launch, or None when it does not split. Rows are
        rounded up to a power of two, so eager steps of any small batch share a few."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        max_context_len = block_table.shape[1] * block_size
        num_splits = decode_num_splits(
            num_decodes,
            num_kv_heads,
            max_context_len,
            self.decode.block_n,
            self.target_decode_programs,
        )
        if num_splits == 1:
            return None
        key = (triton.next_power_of_2(num_decodes), q.shape[1], num_splits, head_dim, q.device)
        if key not in self._partials:
            self._partials[key] = SplitPartials.empty(*key)
        return self._partials[key]
