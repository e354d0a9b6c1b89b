"""Block tables of the persistent batch: one per KV cache group."""

from collections.abc import Sequence

import numpy as np
import torch

from worker.buffers import CpuGpuBuffer, StagedTensor
from worker.slot_mapping import slot_mapping_torch, slot_mapping_triton
from worker.staging_arena import ArenaSlot


class BlockTable:
    """Block ids of every batch row, staged in numpy and committed to the device once
    per step. `np` and `num_blocks_per_row` are the host side; `device_tensor` is what
    the attention kernels and the slot mapping read (a separate tensor even on CPU:
    rows staged after a commit stay invisible until the next one).

    `rows` is where the table stages: the ModelRunner's arena, whose one copy per step
    carries the committed rows, or by default a pair of its own that commit copies into.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device | str,
        rows: StagedTensor | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = torch.device(device)
        if rows is None:
            rows = CpuGpuBuffer(
                max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device, staged=True
            )
        self._buffer = rows
        self.np = self._buffer.np
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.device_tensor = self._buffer.gpu

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {end} blocks, more than {self.max_num_blocks_per_req}"
            )
        self.np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def clear_row(self, row: int) -> None:
        self.np[row, : self.num_blocks_per_row[row]] = 0
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        num_blocks = self.num_blocks_per_row[src]
        self.np[tgt, :num_blocks] = self.np[src, :num_blocks]
        self.num_blocks_per_row[tgt] = num_blocks

    def commit(self, num_reqs: int) -> None:
        """Rows 0..num_reqs-1 go to the device: with the arena's copy, or copied now
        (asynchronously from pinned memory on CUDA)."""
        self._buffer.commit(num_reqs)

    def get_device_tensor(self) -> torch.Tensor:
        return self.device_tensor

    def compute_slot_mapping(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int64 slot of every token of the committed rows; -1 past query_start_loc[-1].
        Written into `out` when given (its length is then the padded length)."""
        compute = slot_mapping_triton if self.device.type == "cuda" else slot_mapping_torch
        return compute(
            self.device_tensor,
            query_start_loc,
            positions,
            self.block_size,
            num_tokens_padded,
            out=out,
        )


class MultiGroupBlockTable:
    """One BlockTable per KV cache group, rows in step: a request's blocks arrive as one
    list per group (`block_ids[g]`), and row moves apply to every group. With `rows`
    ([max_num_reqs, num_groups, max_num_blocks_per_req], in the ModelRunner's arena)
    group g stages in `rows.select(g)`; without, each table in a pair of its own."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device | str,
        num_groups: int = 1,
        rows: ArenaSlot | None = None,
    ) -> None:
        self.groups = [
            BlockTable(
                max_num_reqs,
                max_num_blocks_per_req,
                block_size,
                device,
                None if rows is None else rows.select(g),
            )
            for g in range(num_groups)
        ]

    def add_row(self, block_ids: Sequence[list[int]], row: int) -> None:
        for table, ids in zip(self.groups, block_ids, strict=True):
            table.add_row(ids, row)

    def append_row(self, block_ids: Sequence[list[int]], row: int) -> None:
        for table, ids in zip(self.groups, block_ids, strict=True):
            if ids:
                table.append_row(ids, row)

    def clear_row(self, row: int) -> None:
        for table in self.groups:
            table.clear_row(row)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.groups:
            table.move_row(src, tgt)

    def commit(self, num_reqs: int) -> None:
        for table in self.groups:
            table.commit(num_reqs)
