"""Persistent step inputs, allocated once: the ModelRunner's staging arena and its slots, and
host/device pairs for what lives outside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from attention.batch_split import max_staged_bytes
from worker.slot_mapping import PAD_SLOT_ID
from worker.staging_arena import ALIGNMENT, ArenaSlot, SlotSpec, StagingArena, StagingScratch


class StagedTensor(Protocol):
    """A host tensor `cpu`, its numpy view `np` and a device tensor `gpu` of the same
    shape: fill `np`, then `commit(n)` the first n rows to reach `gpu`."""

    cpu: torch.Tensor
    np: np.ndarray
    gpu: torch.Tensor

    def commit(self, num_rows: int) -> torch.Tensor: ...


class CpuGpuBuffer:
    """A StagedTensor of its own, outside any arena: `commit` copies at once, asynchronously
    from pinned memory on CUDA (so its owner must not rewrite rows a copy may still read).

    On a CPU device `gpu` is `cpu` itself and the copy costs nothing, unless `staged`
    asks for a separate device tensor (a block table whose staged rows must not be seen
    before they are committed).
    """

    def __init__(
        self,
        *shape: int,
        dtype: torch.dtype,
        device: torch.device | str,
        staged: bool = False,
    ) -> None:
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        separate = on_cuda or staged
        self.gpu = torch.zeros(shape, dtype=dtype, device=device) if separate else self.cpu
        self._non_blocking = on_cuda

    def commit(self, num_rows: int) -> torch.Tensor:
        """Copy the first num_rows rows to the device; returns the device rows."""
        if self.gpu is not self.cpu:
            self.gpu[:num_rows].copy_(self.cpu[:num_rows], non_blocking=self._non_blocking)
        return self.gpu[:num_rows]


@dataclass
class BatchStaging:
    """Where the persistent batch stages what its steps read on the device: the sampling
    settings of the sampled rows, and the block tables ([max_num_reqs, num_groups,
    max_blocks_per_req]; None: each group's table stages its rows in a pair of its own)."""

    temperature: StagedTensor
    top_p: StagedTensor
    min_p: StagedTensor
    top_k: StagedTensor
    block_tables: ArenaSlot | None

    @classmethod
    def standalone(cls, max_num_reqs: int, device: torch.device | str) -> BatchStaging:
        """Pairs of its own, copied as they are committed: a batch outside a ModelRunner."""

        def pair(dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(max_num_reqs, dtype=dtype, device=device)

        return cls(
            pair(torch.float32), pair(torch.float32), pair(torch.float32), pair(torch.int32), None
        )


class InputBuffers:
    """The ModelRunner's step inputs in one StagingArena, sized for its largest step
    (max_num_tokens tokens, max_num_reqs requests) and reused by every step, eager or
    CUDA-graph replay alike: a captured graph reads views of these same device tensors.

    A step writes the host views (its own inputs, the batch's sampling settings and block
    tables through `batch_staging`, the attention split through `split_scratch`), commits
    the rows it uses and calls `copy_to_device()`: one copy on CUDA, none on CPU unless
    `separate_device_arena` (tests) asks for the copy path there too. The block tables are
    in the arena only when it is separate; on a shared arena they stage their own rows.
    In the arena the tables of several KV cache groups interleave by row, so each group's
    table is a view with a row stride of num_groups * max_blocks_per_req (the CPU attention
    kernel wants a dense table: a separate arena on CPU with several groups needs the
    torch backend).

    Every slot but the block tables is copied whole, used or not: a step copies 24 bytes
    per max_num_tokens (ids, positions, the split's scratch), about 86 per max_num_reqs,
    and the used rows of the block tables.

    The copy is asynchronous, so a step must not rewrite the host side while the last
    step's copy may still be in flight: call `wait_for_copies()` before writing and
    `record_copies()` once the copy is issued (`copy_to_device()` does).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_num_blocks_per_req: int,
        device: torch.device | str,
        num_kv_cache_groups: int = 1,
        *,
        max_num_logits: int | None = None,
        separate_device_arena: bool = False,
    ) -> None:
        """`max_num_logits`: logits rows of a step at most (a row verifying drafts has
        one per position); max_num_reqs by default."""
        device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.arange = np.arange(max(max_num_reqs, max_num_tokens) + 1, dtype=np.int64)
        reqs, tokens = (max_num_reqs,), (max_num_tokens,)
        logits = (max_num_logits or max_num_reqs,)
        specs = [
            SlotSpec("query_start_loc", (max_num_reqs + 1,), torch.int32),
            SlotSpec("seq_lens", reqs, torch.int32),
            SlotSpec("logits_indices", logits, torch.int64),
            SlotSpec("temperature", logits, torch.float32),
            SlotSpec("top_p", logits, torch.float32),
            SlotSpec("min_p", logits, torch.float32),
            SlotSpec("top_k", logits, torch.int32),
            SlotSpec("input_ids", tokens, torch.int64),
            SlotSpec("positions", tokens, torch.int64),
            # A pipelined step's rows whose input token is the last step's sample, still
            # on the device: token index in input_ids, index in that step's samples.
            SlotSpec("fed_token_indices", reqs, torch.int64),
            SlotSpec("fed_sample_indices", reqs, torch.int64),
        ]
        separate = device.type == "cuda" or separate_device_arena
        if separate:
            scratch_bytes = max_staged_bytes(max_num_reqs, max_num_tokens, ALIGNMENT)
            table_shape = (max_num_reqs, num_kv_cache_groups, max_num_blocks_per_req)
            specs += [
                SlotSpec("split_scratch", (scratch_bytes,), torch.uint8),
                SlotSpec("block_tables", table_shape, torch.int32),  # last: see StagingArena
            ]
        self.arena = StagingArena(specs, device, separate=separate_device_arena)
        slots: dict[str, ArenaSlot] = self.arena.slots
        self.query_start_loc = slots["query_start_loc"]
        self.seq_lens = slots["seq_lens"]
        self.logits_indices = slots["logits_indices"]
        self.input_ids = slots["input_ids"]
        self.positions = slots["positions"]
        self.fed_token_indices = slots["fed_token_indices"]
        self.fed_sample_indices = slots["fed_sample_indices"]
        self.split_scratch = StagingScratch(slots.get("split_scratch"))
        self.batch_staging = BatchStaging(
            slots["temperature"],
            slots["top_p"],
            slots["min_p"],
            slots["top_k"],
            slots.get("block_tables"),
        )
        # One row per KV cache group, computed on the device from that group's block
        # table; PAD_SLOT_ID entries store nothing.
        self.slot_mapping = torch.full(
            (num_kv_cache_groups, max_num_tokens), PAD_SLOT_ID, dtype=torch.int64, device=device
        )
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def pad_decodes(self, num_reqs: int, size: int) -> None:
        """On the host, make rows num_reqs..size-1 of a decode batch (one token per request)
        harmless padding requests: token 0 at position 0 with a context of 1, so they read
        one valid cache slot. Their slots come out PAD_SLOT_ID, so they write nothing."""
        self.input_ids.np[num_reqs:size] = 0
        self.positions.np[num_reqs:size] = 0
        self.seq_lens.np[num_reqs:size] = 1
        self.query_start_loc.np[num_reqs + 1 : size + 1] = np.arange(num_reqs + 1, size + 1)

    def copy_to_device(self) -> None:
        """The step's one host-to-device copy of everything committed since the last."""
        self.arena.copy_to_device()
        self.split_scratch.reset()
        self.record_copies()

    def wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def record_copies(self) -> None:
        if self._copied is not None:
            self._copied.record()
