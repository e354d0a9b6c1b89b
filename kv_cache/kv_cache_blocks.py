"""KVCacheBlocks: blocks handed to the scheduler, one list per KV cache group."""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kv_cache.block import KVCacheBlock


@dataclass
class KVCacheBlocks:
    """`blocks[g]` are the blocks of KV cache group g, in block-table order. Every group
    has an entry, also when the model has a single group."""

    blocks: tuple[list[KVCacheBlock], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, tuple):
            raise TypeError(f"blocks must be a tuple of per-group lists, got {type(self.blocks)}")

    @classmethod
    def empty(cls, num_groups: int) -> "KVCacheBlocks":
        """No blocks in any of `num_groups` groups (KVCacheManager.num_groups)."""
        return cls(tuple([] for _ in range(num_groups)))

    def get_block_ids(self) -> list[list[int]]:
        return [[block.block_id for block in group] for group in self.blocks]

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        """Concatenate group by group (cache hits + newly allocated blocks). Both sides must
        have the same number of groups (ValueError otherwise)."""
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))


def tail_first(tables: Sequence[list[KVCacheBlock]]) -> Iterator[KVCacheBlock]:
    """The blocks of per-group block lists in freeing order: position by position from the
    tail, every group's block of a position before the previous position's."""
    num_positions = max((len(blocks) for blocks in tables), default=0)
    return (
        blocks[i] for i in reversed(range(num_positions)) for blocks in tables if i < len(blocks)
    )
