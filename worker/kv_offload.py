"""The KV host tier: host tensors that mirror the device KV cache, and the block copies
between the two that a SchedulerOutput asks for (blocks_to_swap_out, blocks_to_swap_in).

Each device cache tensor [2, num_blocks, block_size, num_kv_heads, head_dim] has a host
twin [2, num_host_blocks, ...] of the same dtype, pinned when the device is CUDA. A block
id addresses one page in each tensor, so one pair of ids moves a page of every tensor.
On a CPU device both tiers are ordinary CPU memory; the copies are still real copies
between the two pools. fp8 pages are copied as bytes (torch has no fp8 index_copy_).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from attention.kv_cache_dtype import is_fp8

BlockPairs = Sequence[Sequence[int]]

_TIMING_BLOCKS = 8
_TIMING_ROUNDS = 5


class HostKVCache:
    def __init__(self, device_tensors: Sequence[torch.Tensor], num_host_blocks: int) -> None:
        self.device_tensors = list(device_tensors)
        self.device = self.device_tensors[0].device
        pin = self.device.type == "cuda"
        self.host_tensors = [
            torch.zeros((t.shape[0], num_host_blocks, *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
            for t in self.device_tensors
        ]
        self.num_host_blocks = num_host_blocks

    def copy_blocks(self, swap_out: BlockPairs, swap_in: BlockPairs) -> None:
        """Copy every (device block, host block) of `swap_out`, then every (host block,
        device block) of `swap_in`: a device block both swapped out and swapped in ends
        with the host's data, and the host keeps its old data. Synchronous for swap_out
        (the host side is written here); swap_in is queued on the device's stream, ahead
        of the forward that reads it."""
        device_tensors = [_as_bytes(t) for t in self.device_tensors]
        host_tensors = [_as_bytes(t) for t in self.host_tensors]
        if swap_out:
            device_ids, host_ids = _split(swap_out, self.device)
            for device_tensor, host_tensor in zip(device_tensors, host_tensors, strict=True):
                pages = device_tensor.index_select(1, device_ids).to("cpu")
                host_tensor.index_copy_(1, host_ids, pages)
        if swap_in:
            host_ids, device_ids = _split(swap_in, self.device, device_side=1)
            pin = self.device.type == "cuda"
            for device_tensor, host_tensor in zip(device_tensors, host_tensors, strict=True):
                shape = (host_tensor.shape[0], len(swap_in), *host_tensor.shape[2:])
                staged = torch.empty(shape, dtype=host_tensor.dtype, pin_memory=pin)
                torch.index_select(host_tensor, 1, host_ids, out=staged)
                pages = staged.to(self.device, non_blocking=pin)
                device_tensor.index_copy_(1, device_ids, pages)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 views (same bytes); others as they are."""
    return tensor.view(torch.uint8) if is_fp8(tensor.dtype) else tensor


def _split(
    pairs: BlockPairs, device: torch.device, device_side: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two columns of `pairs` as index tensors: column `device_side` on the device,
    the other on the host."""
    columns = torch.tensor(pairs, dtype=torch.long).T
    first, second = columns[0], columns[1]
    if device_side == 0:
        return first.to(device), second
    return first, second.to(device)


def measure_block_copy_seconds(
    group_size: int, page_shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> float:
    """Seconds to copy one block one way: the median of a few round trips of a few blocks
    between temporary device and host tensors, each synchronised on CUDA."""
    shape = (2, _TIMING_BLOCKS, *page_shape)
    device_tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(group_size)]
    host = HostKVCache(device_tensors, _TIMING_BLOCKS)
    pairs = [(i, i) for i in range(_TIMING_BLOCKS)]
    host.copy_blocks(pairs, pairs)  # warm up
    rounds = []
    for _ in range(_TIMING_ROUNDS):
        _synchronize(device)
        start = time.perf_counter()
        host.copy_blocks(pairs, pairs)
        _synchronize(device)
        rounds.append(time.perf_counter() - start)
    return statistics.median(rounds) / (2 * _TIMING_BLOCKS)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
