"""A step's batch split into decodes and prefills, computed once on the host."""

from dataclasses import dataclass

import numpy as np
import torch

Rows = slice | torch.Tensor


@dataclass
class BatchSplit:
    """Decodes (query_len 1) and prefills (query_len > 1); requests with no query tokens
    (padding) are in neither.

    `*_reqs` are request indices on the device. `*_rows` select the group's token rows
    of q/k/v: a slice (a view, no copy) when the group's requests are consecutive, as in
    a decode-first batch, otherwise an index tensor. Both index the same way:
    `q[rows]`, `out[rows] = ...`.
    """

    decode_reqs: torch.Tensor
    decode_rows: Rows
    decode_groups: list["DecodeGroup"]
    prefill_reqs: torch.Tensor
    prefill_rows: Rows
    prefill_reqs_cpu: list[int]
    max_decode_seq_len: int
    max_prefill_query_len: int
    max_prefill_seq_len: int
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32: within prefill_rows
    prefill_seq_start_loc: torch.Tensor  # [num_prefills + 1] int32: cumulative seq_lens

    @property
    def num_decodes(self) -> int:
        return self.decode_reqs.shape[0]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_reqs_cpu)


@dataclass
class DecodeGroup:
    """Decodes of similar context length, for backends that pad each call's context to
    its longest request (the torch backend)."""

    reqs: torch.Tensor
    rows: Rows
    max_seq_len: int


# A torch-backend decode call costs about its requests x its longest context: sorting
# the decodes by length into a few groups cuts the padding (a third with uniform lengths
# and four groups) for a few more calls.
_MAX_DECODE_GROUPS = 4
_MIN_DECODE_GROUP = 8


def split_batch(
    query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, device: torch.device
) -> BatchSplit:
    query_start_loc = query_start_loc_cpu.numpy().astype(np.int64)
    seq_lens = seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(query_start_loc)
    decodes = np.flatnonzero(query_lens == 1)
    prefills = np.flatnonzero(query_lens > 1)

    def to_device(array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

    def rows_of(reqs: np.ndarray) -> Rows:
        if len(reqs) == 0:
            return slice(0, 0)
        if reqs[-1] - reqs[0] + 1 == len(reqs):
            return slice(int(query_start_loc[reqs[0]]), int(query_start_loc[reqs[-1] + 1]))
        lens = query_lens[reqs]
        offsets = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        return to_device(np.repeat(query_start_loc[reqs], lens) + offsets)

    def cumulative(lens: np.ndarray) -> torch.Tensor:
        return to_device(np.concatenate(([0], np.cumsum(lens))), torch.int32)

    def decode_groups() -> list[DecodeGroup]:
        by_length = decodes[np.argsort(seq_lens[decodes], kind="stable")]
        num_groups = min(_MAX_DECODE_GROUPS, max(1, len(decodes) // _MIN_DECODE_GROUP))
        return [
            DecodeGroup(to_device(np.sort(g)), rows_of(np.sort(g)), int(seq_lens[g].max()))
            for g in np.array_split(by_length, num_groups)
            if len(g)
        ]

    return BatchSplit(
        decode_reqs=to_device(decodes),
        decode_rows=rows_of(decodes),
        decode_groups=decode_groups(),
        prefill_reqs=to_device(prefills),
        prefill_rows=rows_of(prefills),
        prefill_reqs_cpu=prefills.tolist(),
        max_decode_seq_len=int(seq_lens[decodes].max(initial=0)),
        max_prefill_query_len=int(query_lens[prefills].max(initial=0)),
        max_prefill_seq_len=int(seq_lens[prefills].max(initial=0)),
        prefill_query_start_loc=cumulative(query_lens[prefills]),
        prefill_seq_start_loc=cumulative(seq_lens[prefills]),
    )
