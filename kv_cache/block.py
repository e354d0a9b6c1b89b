"""One page of the paged KV cache."""

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """A fixed-size page of KV cache. Compared by identity, never by value."""

    block_id: int
    ref_cnt: int = 0
    _block_hash: bytes | None = field(default=None, repr=False)
    # Links of the free queue; both None while the block is not in the queue.
    prev_free_block: "KVCacheBlock | None" = field(default=None, repr=False)
    next_free_block: "KVCacheBlock | None" = field(default=None, repr=False)
    is_null: bool = False

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: bytes) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None
