"""Host tensors on transparent huge pages: what the CPU kernels stream (the KV cache's pages,
packed weights) costs a TLB miss per 4 KB page otherwise, and the hardware prefetchers stop
at each 4 KB page's end."""

from __future__ import annotations

import math
import mmap

import torch


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on transparent huge pages where the kernel allows them. Its
    pages are zeroed by the kernel when first touched (the KV cache's are faulted in ahead
    of the steps: worker/host_pages.py's `FaultInBehind`)."""
    numel = math.prod(shape)
    nbytes = max(1, numel * dtype.itemsize)
    # Private and anonymous: zero-filled as pages are first touched. (A shared mapping, the
    # default of mmap.mmap(-1, n), is shmem, which gets huge pages only where
    # transparent_hugepage/shmem_enabled allows them: "never" by default.)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


def copy_to_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor on huge pages (the whole 2 MB pages of its span;
    the kernel gives the ends 4 KB pages). A kernel's packed weight, streamed every decode
    step: SmolLM2's float32 panels at 1-64 rows 1.5-15 % faster, bf16 AMX tiles 0-8 %
    (2 Emerald Rapids cores, same process, alternated)."""
    copy = zeros_on_huge_pages(tuple(tensor.shape), tensor.dtype)
    copy.copy_(tensor)
    return copy
