"""Persistent step inputs: host buffers paired with device buffers, allocated once."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from worker.slot_mapping import PAD_SLOT_ID


class CpuGpuBuffer:
    """A host tensor `cpu` (pinned when the device is CUDA), its numpy view `np`, and a
    device tensor `gpu` of the same shape. Fill `np`, then `copy_to_gpu(n)`.

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

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first n rows (all when None) to the device, asynchronously from pinned
        memory on CUDA; returns the device rows."""
        rows = slice(None) if n is None else slice(0, n)
        if self.gpu is not self.cpu:
            self.gpu[rows].copy_(self.cpu[rows], non_blocking=self._non_blocking)
        return self.gpu[rows]


class InputBuffers:
    """The ModelRunner's step inputs, sized for its largest step (max_num_tokens tokens,
    max_num_reqs requests) and reused by every step, eager or CUDA-graph replay alike: a
    captured graph reads views of these same device tensors.

    The copies are asynchronous, so a step must not rewrite the host side while the last
    step's copies may still be in flight: call `wait_for_copies()` before writing and
    `record_copies()` once the step's copies are issued.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        device: torch.device,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.arange = np.arange(max(max_num_reqs, max_num_tokens) + 1, dtype=np.int64)
        self.input_ids = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.query_start_loc = CpuGpuBuffer(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)
        self.logits_indices = CpuGpuBuffer(max_num_reqs, dtype=torch.int64, device=device)
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

    def wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def record_copies(self) -> None:
        if self._copied is not None:
            self._copied.record()


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on transparent huge pages where the kernel allows them. The KV
    cache is read in scattered pages of a few KB: with 4 KB pages nearly every one costs
    a TLB miss, with 2 MB pages almost none does."""
    numel = math.prod(shape)
    nbytes = max(1, numel * dtype.itemsize)
    memory = mmap.mmap(-1, nbytes)  # anonymous: zero-filled as pages are first touched
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)
