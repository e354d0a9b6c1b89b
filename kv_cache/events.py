"""KV cache events, recorded by the BlockPool when enable_kv_cache_events is set."""

from dataclasses import dataclass


@dataclass(slots=True)
class BlockStored:
    """Blocks that became cached; their hashes chain on from parent_block_hash."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
