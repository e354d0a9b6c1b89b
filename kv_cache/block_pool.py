"""The pool of KV cache blocks: allocation, reference counts and the prefix cache."""

from collections.abc import Callable, Iterable

from kv_cache.block import BlockHashWithGroupId, KVCacheBlock
from kv_cache.free_queue import FreeKVCacheBlockQueue
from kv_cache.request import KVCacheRequest

NULL_BLOCK_ID = 0  # the null block: the pool's first, standing in for blocks not held


class BlockPool:
    """Owns every block. Block 0 is the null block, a placeholder that is never allocated.

    Eviction is lazy: a freed block keeps its hash (and stays a cache hit) until
    get_new_blocks pops it from the free queue for reuse. Every KV cache group caches its
    own blocks under the same request block hashes, so the cache is keyed by
    (block_hash, group_id).

    `is_host` makes a pool of host-tier blocks (their `is_host` is set).
    `on_last_copy_evicted`, when set, is called with a block about to lose its hash when no
    other block of the pool caches that key (the host tier spills it).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        is_host: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.is_host = is_host
        self.blocks = [KVCacheBlock(i, is_host=is_host) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()  # block NULL_BLOCK_ID
        self.null_block.is_null = True
        # One key may name several blocks (no deduplication): {key: {block_id: block}}.
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        self.on_last_copy_evicted: Callable[[KVCacheBlock], None] | None = None

    def get_cached_block(self, block_hash: bytes, group_id: int) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get((block_hash, group_id))
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks, {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def _evict_cached_block(self, block: KVCacheBlock, spill: bool = True) -> None:
        """Drop the block's hash; the last copy of a key goes to `on_last_copy_evicted`
        (the host tier) when `spill`."""
        cache_key = block.cache_key
        same_key = self.cached_block_hash_to_block[cache_key]
        del same_key[block.block_id]
        if not same_key:
            del self.cached_block_hash_to_block[cache_key]
            if spill and self.on_last_copy_evicted is not None:
                self.on_last_copy_evicted(block)
        block.reset_hash()

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop the hashes of blocks whose tokens were never computed: nothing may hit
        them, and nothing is spilled to the host tier."""
        for block in blocks:
            if block.cache_key is not None:
                self._evict_cached_block(block, spill=False)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit nobody held leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching 0 join the free queue's tail in the
        given order (so the first one given is evicted first). Their hashes are kept."""
        freed = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed)

    def cache_full_blocks(
        self,
        request: KVCacheRequest,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] (blocks of KV cache group
        `group_id`) the request's hashes and cache them."""
        block_hashes = request.block_hashes
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            block.cache_key = (block_hashes[i], group_id)
            self.cached_block_hash_to_block.setdefault(block.cache_key, {})[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, cache_key: BlockHashWithGroupId) -> None:
        """Cache one block under a key it got from a copy in the other tier."""
        block.cache_key = cache_key
        self.cached_block_hash_to_block.setdefault(cache_key, {})[block.block_id] = block

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True
