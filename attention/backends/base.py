"""The contract every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from attention.metadata import AttentionMetadata, CommonAttentionMetadata
from attention.rotation import RopeTables
from attention.spec import AttentionSpec
from attention.store_kv import store_kv_torch


class AttentionBackend(ABC):
    """How a step's attention runs, and how its K/V reach the paged cache.

    Eager steps: the model runner lays out the batch (CommonAttentionMetadata) and calls
    `build_metadata` once, before the forward pass; each Attention layer stores its K/V
    by the slot mapping (`store_kv`, or `rotate_and_store_kv`) and calls `forward` with
    its AttentionSpec and that metadata.

    CUDA graphs (worker/cuda_graph.py) capture pure-decode batches padded to a few
    sizes. For each size, `build_cudagraph_metadata` runs once, before capture, over
    views of the runner's persistent buffers; each replay is preceded by
    `prepare_replay` once the step's inputs sit in those buffers. `cudagraph_support`
    says whether the store and `forward` on such metadata depend only on device values and
    the padded size, i.e. whether they may be captured at all.
    """

    name: ClassVar[str]
    cudagraph_support: bool = False

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """The step's metadata: the batch and its split into decodes and prefills."""
        return AttentionMetadata.from_common(common, split=common.compute_split())

    def build_cudagraph_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """The metadata every replay of one captured size runs with. `common`'s device
        tensors are views of persistent buffers that each step rewrites, and its host
        fields are upper bounds (every row a decode of max_model_len tokens): nothing
        built here may depend on one step's values, and no host-to-device copy may be
        left for the capture to record."""
        return self.build_metadata(common)

    def prepare_replay(self, md: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Called outside any graph before each replay over `md`, after the step's inputs
        were written to the buffers it views: drop what was derived from earlier values."""

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write k/v ([T, num_kv_heads, head_size]) into kv_cache ([2, num_blocks,
        block_size, num_kv_heads, head_size]) at flat slot ids; slot -1 (padding) is
        skipped. An fp8 cache stores them divided by the layer's scales, as
        `store_kv_torch` does. Here with torch ops; a backend with a kernel of its own
        overrides it."""
        store_kv_torch(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def rotate_and_store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        tables: RopeTables,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> bool:
        """Rotate q and k ([T, heads, head_size]) in place by `tables` and store k and v as
        `store_kv` does, in one kernel, where the backend has one that takes these tensors.
        False: nothing was done, and the layer rotates and then calls `store_kv`."""
        return False

    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of the step's query rows: q [T, num_heads, head_dim], k/v [T,
        num_kv_heads, head_dim] (already in kv_cache; fp8 pages read times spec.k_scale
        and spec.v_scale), the output like q with the padding rows past
        md.num_actual_tokens zeroed."""
        out = torch.empty_like(q)
        if md.num_actual_tokens < q.shape[0]:
            out[md.num_actual_tokens :] = 0
        self.attend(spec, q, k, v, kv_cache, md, out)
        return out

    @abstractmethod
    def attend(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """`forward`'s work: write the attention of rows 0..md.num_actual_tokens - 1 into
        `out`."""
