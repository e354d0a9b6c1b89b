from dataclasses import dataclass
from functools import cached_property

import torch

from attention.batch_split import BatchSplit, split_batch


@dataclass
class AttentionMetadata:
    """What every attention layer needs to know about one step's batch.

    Requests may appear in any order and mix prefills, chunked prefills and decodes.
    Request i's query tokens are rows query_start_loc[i]:query_start_loc[i+1] of q/k/v;
    they sit at the last (query_len) positions of its seq_lens[i] tokens of context.
    Rows past num_actual_tokens are padding (slot -1): their output is ignored.
    Build a new instance per step: `split` is computed on first use and then cached.
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

    @cached_property
    def split(self) -> BatchSplit:
        """Decodes and prefills of this step, shared by all layers."""
        return split_batch(self.query_start_loc_cpu, self.seq_lens_cpu, self.seq_lens.device)
