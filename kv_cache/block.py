"""One page of the paged KV cache."""

from dataclasses import dataclass, field

# A prefix-cache key: the same request block hash names one block in every KV cache group.
BlockHashWithGroupId = tuple[bytes, int]


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """A fixed-size page of KV cache. Compared by identity, never by value."""

    block_id: int
    ref_cnt: int = 0
    _cache_key: BlockHashWithGroupId | None = field(default=None, repr=False)
    # Links of the free queue; both None while the block is not in the queue.
    prev_free_block: "KVCacheBlock | None" = field(default=None, repr=False)
    next_free_block: "KVCacheBlock | None" = field(default=None, repr=False)
    is_null: bool = False
    # A block of the host tier (pinned CPU memory), not of the device.
    is_host: bool = False

    @property
    def cache_key(self) -> BlockHashWithGroupId | None:
        """(block_hash, group_id) while the block is cached, else None."""
        return self._cache_key

    @cache_key.setter
    def cache_key(self, cache_key: BlockHashWithGroupId) -> None:
        assert self._cache_key is None, f"block {self.block_id} already has a hash"
        self._cache_key = cache_key

    @property
    def block_hash(self) -> bytes | None:
        return None if self._cache_key is None else self._cache_key[0]

    def reset_hash(self) -> None:
        self._cache_key = None
