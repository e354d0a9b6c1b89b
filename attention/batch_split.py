"""A step's batch split into decodes and prefills, computed once on the host."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

Rows = slice | torch.Tensor
# Places a host array on the device as the given dtype.
ToDevice = Callable[[np.ndarray, torch.dtype], torch.Tensor]


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


def max_staged_bytes(max_num_reqs: int, max_num_tokens: int, alignment: int) -> int:
    """What one split_batch hands `to_device` at most, each array padded to `alignment`:
    int64 indices, at most four per decode request (its index and row, both again in its
    decode group), one per prefill request and one per token (prefill rows that are not
    consecutive), and two int32 cumulative arrays of num_prefills + 1."""
    num_arrays = 6 + 2 * _MAX_DECODE_GROUPS
    index_bytes = 8 * (4 * max_num_reqs + max_num_tokens)
    cumulative_bytes = 2 * 4 * (max_num_reqs + 1)
    return index_bytes + cumulative_bytes + num_arrays * alignment


def split_batch(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    device: torch.device,
    to_device: ToDevice | None = None,
) -> BatchSplit:
    """The split of a batch given on the host. `to_device` places each index array on the
    device: by default a copy of its own; the model runner stages them with the step's
    other inputs, to travel in its one copy."""
    query_start_loc = query_start_loc_cpu.numpy().astype(np.int64)
    seq_lens = seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(query_start_loc)
    decodes = np.flatnonzero(query_lens == 1)
    prefills = np.flatnonzero(query_lens > 1)

    def own_copy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

    place = to_device or own_copy

    def rows_of(reqs: np.ndarray) -> Rows:
        if len(reqs) == 0:
            return slice(0, 0)
        if reqs[-1] - reqs[0] + 1 == len(reqs):
            return slice(int(query_start_loc[reqs[0]]), int(query_start_loc[reqs[-1] + 1]))
        lens = query_lens[reqs]
        offsets = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        return place(np.repeat(query_start_loc[reqs], lens) + offsets, torch.int64)

    def cumulative(lens: np.ndarray) -> torch.Tensor:
        return place(np.concatenate(([0], np.cumsum(lens))), torch.int32)

    def decode_groups() -> list[DecodeGroup]:
        by_length = decodes[np.argsort(seq_lens[decodes], kind="stable")]
        num_groups = min(_MAX_DECODE_GROUPS, max(1, len(decodes) // _MIN_DECODE_GROUP))
        return [
            DecodeGroup(place(np.sort(g), torch.int64), rows_of(np.sort(g)), int(seq_lens[g].max()))
            for g in np.array_split(by_length, num_groups)
            if len(g)
        ]

    return BatchSplit(
        decode_reqs=place(decodes, torch.int64),
        decode_rows=rows_of(decodes),
        decode_groups=decode_groups(),
        prefill_reqs=place(prefills, torch.int64),
        prefill_rows=rows_of(prefills),
        prefill_reqs_cpu=prefills.tolist(),
        max_decode_seq_len=int(seq_lens[decodes].max(initial=0)),
        max_prefill_query_len=int(query_lens[prefills].max(initial=0)),
        max_prefill_seq_len=int(seq_lens[prefills].max(initial=0)),
        prefill_query_start_loc=cumulative(query_lens[prefills]),
        prefill_seq_start_loc=cumulative(seq_lens[prefills]),
    )
