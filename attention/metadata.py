"""Attention metadata: the step's batch as the model runner lays it out, and what a backend
builds from it before the forward pass."""

from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from attention.batch_split import BatchSplit, split_batch

_Metadata = TypeVar("_Metadata", bound="AttentionMetadata")


@dataclass
class CommonAttentionMetadata:
    """What every attention backend needs to know about one step's batch.

    Requests may appear in any order and mix prefills, chunked prefills and decodes.
    Request i's query tokens are rows query_start_loc[i]:query_start_loc[i+1] of q/k/v;
    they sit at the last (query_len) positions of its seq_lens[i] tokens of context.
    Rows past num_actual_tokens are padding (slot -1): their output is ignored.
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device: context incl. this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device; -1 = padding, not stored
    query_start_loc_cpu: torch.Tensor  # the same on the host, to avoid device syncs
    seq_lens_cpu: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    def compute_split(self) -> BatchSplit:
        """The batch's decodes and prefills, worked out on the host (one copy each of
        the resulting index tensors to the device)."""
        return split_batch(self.query_start_loc_cpu, self.seq_lens_cpu, self.seq_lens.device)


@dataclass
class AttentionMetadata(CommonAttentionMetadata):
    """The batch plus what its backend derived from it on the host (`build_metadata`),
    shared by every layer of the forward pass."""

    split: BatchSplit  # decodes and prefills of this step

    @classmethod
    def from_common(
        cls: type[_Metadata], common: CommonAttentionMetadata, **derived: Any
    ) -> _Metadata:
        batch = {f.name: getattr(common, f.name) for f in fields(CommonAttentionMetadata)}
        return cls(**batch, **derived)
