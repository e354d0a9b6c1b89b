"""The contract every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from attention.metadata import AttentionMetadata, CommonAttentionMetadata

if TYPE_CHECKING:
    from attention.layer import Attention


class AttentionBackend(ABC):
    """How a step's attention runs.

    Eager steps: the model runner lays out the batch (CommonAttentionMetadata) and calls
    `build_metadata` once, before the forward pass; each Attention layer stores its K/V
    by the slot mapping and calls `forward` with that metadata.

    CUDA graphs (worker/cuda_graph.py) capture pure-decode batches padded to a few
    sizes. For each size, `build_cudagraph_metadata` runs once, before capture, over
    views of the runner's persistent buffers; each replay is preceded by
    `prepare_replay` once the step's inputs sit in those buffers. `cudagraph_support`
    says whether `forward` on such metadata depends only on device values and the padded
    size, i.e. whether it may be captured at all.
    """

    name: ClassVar[str]
    cudagraph_support: ClassVar[bool] = False

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

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of the step's query rows: q [T, num_heads, head_dim], k/v [T,
        num_kv_heads, head_dim] (already in kv_cache), the output like q with the
        padding rows past md.num_actual_tokens zeroed."""
        out = torch.empty_like(q)
        out[md.num_actual_tokens :] = 0
        self.attend(layer, q, k, v, kv_cache, md, out)
        return out

    @abstractmethod
    def attend(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """`forward`'s work: write the attention of rows 0..md.num_actual_tokens - 1 into
        `out`."""
