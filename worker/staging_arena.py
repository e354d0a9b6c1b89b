"""One host arena and one device arena with the same typed views: a step writes its inputs
into the host views, then one non-blocking copy of the used byte range moves them all."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Bytes. Every slot, and every array staged in a scratch slot, starts on such a boundary
# (the CUDA allocator's own alignment, enough for any vectorised load of a kernel).
ALIGNMENT = 256


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class SlotSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class StagingArena:
    """Typed slots at aligned offsets, in the order given, each sized for the largest step.

    On CUDA the host arena is pinned and the device arena is a device buffer of the same
    size; on CPU the device arena is the host arena itself and nothing is ever copied,
    unless `separate` asks for a distinct one (so tests can drive the copy path on CPU).

    A step writes host views, `commit`s the rows it uses, then calls `copy_to_device()`
    once: one copy of the bytes from the arena's start to the furthest committed row.
    Slots before that row's slot are copied whole, committed or not, so a slot whose
    uncommitted rows must stay invisible on the device (staged block-table rows) goes
    last, and so does the largest. The device views keep their addresses for the arena's
    life (CUDA graphs read them).
    """

    def __init__(
        self, specs: Sequence[SlotSpec], device: torch.device | str, *, separate: bool = False
    ) -> None:
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        offsets = []
        total = 0
        for spec in specs:
            offsets.append(total)
            total += align(spec.nbytes)
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda)
        self.separate = on_cuda or separate
        self.device_bytes = self.host
        if self.separate:
            self.device_bytes = torch.zeros(total, dtype=torch.uint8, device=self.device)
        self._non_blocking = on_cuda
        self._end = 0
        self.slots = {
            spec.name: ArenaSlot.of(self, offset, spec)
            for spec, offset in zip(specs, offsets, strict=True)
        }

    def commit_until(self, end: int) -> None:
        """Bytes 0..end-1 go to the device with the next copy."""
        if end > self._end:
            self._end = end

    def copy_to_device(self) -> int:
        """Issue the one copy of the committed bytes (none on a shared arena) and start
        the next step's range; returns how many bytes it copies."""
        end, self._end = self._end, 0
        if not self.separate or end == 0:
            return 0
        self.device_bytes[:end].copy_(self.host[:end], non_blocking=self._non_blocking)
        return end


class ArenaSlot:
    """A typed view of the arena: `cpu` (host), `np` (its numpy view) and `gpu` (the same
    bytes of the device arena; `cpu` itself on a shared arena). Rows run along dim 0."""

    def __init__(
        self,
        arena: StagingArena,
        offset: int,
        row_bytes: int,
        cpu: torch.Tensor,
        gpu: torch.Tensor,
    ) -> None:
        self._arena = arena
        self._offset = offset
        self._row_bytes = row_bytes
        self.cpu = cpu
        self.np: np.ndarray = cpu.numpy()
        self.gpu = gpu

    @classmethod
    def of(cls, arena: StagingArena, offset: int, spec: SlotSpec) -> ArenaSlot:
        def view(buffer: torch.Tensor) -> torch.Tensor:
            return buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)

        cpu = view(arena.host)
        gpu = view(arena.device_bytes) if arena.separate else cpu
        row_bytes = cpu.stride(0) * spec.dtype.itemsize if spec.shape else spec.nbytes
        return cls(arena, offset, row_bytes, cpu, gpu)

    def commit(self, num_rows: int) -> torch.Tensor:
        """Rows 0..num_rows-1 reach the device with the arena's next copy; returns their
        device view."""
        self._arena.commit_until(self._offset + num_rows * self._row_bytes)
        return self.gpu[:num_rows]

    def select(self, index: int) -> ArenaSlot:
        """Index `index` of dim 1 of every row (one KV cache group of the block tables),
        committed row by row with the whole slot."""
        return ArenaSlot(
            self._arena, self._offset, self._row_bytes, self.cpu[:, index], self.gpu[:, index]
        )


class StagingScratch:
    """Arrays of one step with no slot of their own (their number and sizes vary, like
    the batch split's index tensors), packed into a byte slot of a separate arena and
    forgotten at `reset()`, once the step's copy is issued. Without a slot (a shared
    arena) an array is wrapped as it is: the host is the device."""

    def __init__(self, slot: ArenaSlot | None) -> None:
        self._slot = slot
        self._used = 0

    def stage(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """`array` as `dtype` on the device, once the arena's copy has run."""
        if self._slot is None:
            return torch.from_numpy(array).to(dtype)
        start = self._used
        end = start + array.size * dtype.itemsize
        if end > self._slot.np.shape[0]:
            raise RuntimeError(
                f"staging scratch of {self._slot.np.shape[0]} bytes is too small for "
                f"{end} bytes: its bound is wrong"
            )
        self._slot.np[start:end].view(_numpy_dtype(dtype))[:] = array.reshape(-1)
        self._used = align(end)
        self._slot.commit(end)
        return self._slot.gpu[start:end].view(dtype).view(array.shape)

    def reset(self) -> None:
        self._used = 0


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
