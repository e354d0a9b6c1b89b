"""The KV cache's host memory (on huge pages: kernels/huge_pages.py), faulted in behind the
engine's back."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

_MADV_POPULATE_WRITE = 23  # Linux 5.14+; the mmap module of Python 3.11 does not name it
_CHUNK = 2 << 20  # one huge page
_QUIET_S = 0.05


class FaultInBehind:
    """Faults in the pages of `tensors` on a thread, while no step runs.

    The kernel zeroes a page on its first touch: 4 GiB of KV cache cost 10 s on a VM of this
    project (huge pages there cost 2.4 s per GiB, 4 KB pages 0.8), which, done at start,
    was two thirds of a warm `LLM` start. The thread uses MADV_POPULATE_WRITE, which faults
    in what is missing and never changes a page already there, so steps write the cache
    meanwhile and fault in themselves what they reach first. It holds off while a step runs
    and for _QUIET_S after one (`held_off`): on a VM a vCPU stays in the hypervisor for a
    huge page's whole fault, which no guest priority preempts, and zeroing would take the
    memory bandwidth a decode step lives on. So it works through the rest of the start and
    whenever the engine idles, at idle priority (SCHED_IDLE) besides. It takes the same
    offset of every leading slice of every tensor together (a KV tensor's K and V halves,
    so block b of every layer before block b + 1: the pool hands out low block ids first)
    and stops when the tensors are freed or `stop` is called. Kernels before 5.14 refuse
    the advice: then the steps fault in every page."""

    def __init__(self, tensors: list[torch.Tensor], at_start: bool = False) -> None:
        """`at_start`: fault every page in now, before returning, on this thread (engines
        that are compared against each other in one benchmark: an engine faulting its
        pages in behind would slow the one being measured)."""
        self._refs = [weakref.ref(tensor) for tensor in tensors]
        self._steps_running = 0
        self._quiet_from = 0.0
        self._stopped = False
        self.thread: threading.Thread | None = None
        if at_start:
            self._fault_in()
            return
        self.thread = threading.Thread(target=self._run, name="kv-fault-in", daemon=True)
        self.thread.start()

    @contextlib.contextmanager
    def held_off(self) -> Iterator[None]:
        """Around a step: the thread waits for it, and _QUIET_S more."""
        self._steps_running += 1
        try:
            yield
        finally:
            self._steps_running -= 1
            self._quiet_from = time.monotonic() + _QUIET_S

    def stop(self) -> None:
        """Stop the thread and wait for it, so that it holds none of the tensors (at most a
        chunk's fault-in to wait for)."""
        self._stopped = True
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        if hasattr(os, "SCHED_IDLE"):  # this thread alone; where refused, it runs as it is
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        self._fault_in()

    def _fault_in(self) -> None:
        offset = 0
        while True:
            pending = False
            for ref in self._refs:
                while not self._stopped and (
                    self._steps_running or time.monotonic() < self._quiet_from
                ):
                    time.sleep(_QUIET_S)
                tensor = ref()
                if tensor is None or self._stopped:
                    return
                slices = tensor.shape[0] if tensor.dim() else 1
                slice_bytes = tensor.nbytes // max(slices, 1)
                length = min(_CHUNK, slice_bytes - offset)
                pending |= length > 0
                for index in range(slices if length > 0 else 0):
                    if not _populate(tensor.data_ptr() + index * slice_bytes + offset, length):
                        return
                del tensor  # held no longer than a chunk: the engine may free it meanwhile
            if not pending:
                return
            offset += _CHUNK


def _populate(address: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over the pages holding [address, address + length); False where
    the kernel refuses it. ctypes lets go of the GIL for the call."""
    start = address - address % mmap.PAGESIZE
    return _madvise()(start, address + length - start, _MADV_POPULATE_WRITE) == 0


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise
