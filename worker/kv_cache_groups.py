"""KV cache groups: the model's layers grouped by attention type (vLLM V1's hybrid
allocator, with one page size for every layer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]


def group_layers(windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """Group layer indices by sliding window (None: full attention), every group at most
    `group_size` layers, so the cache needs only `group_size` tensors: the j-th layer of
    every group shares tensor j, addressed by block ids that belong to one group at a
    time. One block id then costs `group_size` layers' pages, not every layer's.

    With one attention type there is one group of all layers. With several, group_size is
    the largest type's layer count when the counts are within 25 % of each other (no type
    is split), else the smallest's (larger types split into several groups; Gemma 3's
    five local layers to one global give groups of the global layers' count)."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in by_window.values()]
    group_size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    return [
        KVCacheGroup(window, tuple(layers[i : i + group_size]))
        for window, layers in by_window.items()
        for i in range(0, len(layers), group_size)
    ]


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """Tensors the cache needs: the most layers in one group."""
    return max(len(group.layers) for group in groups)
