"""Per-attention-type block bookkeeping: which blocks each request holds, and cache hits."""

from kv_cache.block import KVCacheBlock
from kv_cache.block_pool import BlockPool
from kv_cache.request import KVCacheRequest


def cdiv(a: int, b: int) -> int:
    """ipc.utils.cdiv: kv_cache imports no other package of the project."""
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group (layers of one attention type). A request's block
    list only ever grows at the end; blocks that fall out of the attention window are
    swapped for the null block. The group's blocks are cached under (hash, group_id)."""

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.null_block = block_pool.null_block
        # Per-block prefix-cache lookup; the KVCacheManager widens it to the host tier.
        self.get_cached_block = block_pool.get_cached_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no future token attends to."""
        return 0

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        raise NotImplementedError

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free blocks that holding `num_tokens` would consume: new blocks, plus cache hits
        nobody holds (touching them takes them out of the free queue), plus host-tier hits
        (each is copied into a new device block)."""
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(0, cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks))
        if not new_computed_blocks:
            return num_new
        return num_new + sum(
            1 for b in new_computed_blocks if (b.ref_cnt == 0 or b.is_host) and not b.is_null
        )

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: list[KVCacheBlock]
    ) -> None:
        if not new_computed_blocks:
            return
        self.block_pool.touch(new_computed_blocks)
        self.set_computed_blocks(request_id, new_computed_blocks, len(new_computed_blocks))

    def set_computed_blocks(
        self, request_id: str, computed_blocks: list[KVCacheBlock], num_cached_blocks: int
    ) -> None:
        """Start the request's block list with blocks it already holds a reference on, the
        first `num_cached_blocks` of them cached."""
        if not computed_blocks:
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not blocks, "cache hits are only taken by a request holding no blocks"
        blocks.extend(computed_blocks)
        self.num_cached_block[request_id] = num_cached_blocks

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Cache the request's blocks that are full within its first `num_tokens` tokens."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.group_id,
        )
        self.num_cached_block[request_id] = num_full

    def uncache_uncomputed_blocks(self, request: KVCacheRequest) -> None:
        """Blocks the request cached for tokens it has not computed (they were scheduled
        in this step, then the request was preempted) lose their hashes."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_computed = request.num_computed_tokens // self.block_size
        if num_cached <= num_computed:
            return
        self.block_pool.uncache_blocks(self.req_to_blocks[request_id][num_computed:num_cached])
        self.num_cached_block[request_id] = num_computed

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and hand back its block list, still referenced: the caller
        frees it (KVCacheManager interleaves the groups)."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Swap blocks wholly before the window for the null block and free them, scanning
        right to left and stopping at the first null (everything before it is null too)."""
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if not num_skipped_blocks or not blocks:
            return
        removed = []
        for i in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = self.null_block
        self.block_pool.free_blocks(removed)


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        """Leading run of cached blocks, at most max_length // block_size of them."""
        hits = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(
        self, block_pool: BlockPool, block_size: int, group_id: int, sliding_window: int
    ) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        super().__init__(block_pool, block_size, group_id)
        self.sliding_window = sliding_window
        # Blocks needed to hold the window - 1 tokens the next token attends back to.
        self.window_blocks = max(1, cdiv(sliding_window - 1, block_size))

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        """Only the last window of a prefix matters. Scan right to left for the rightmost run
        of `window_blocks` contiguous hits and return it with null blocks padded in front.
        Without such a run, a hit run starting at block 0 still counts (nothing precedes it).
        """
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        run: list[KVCacheBlock] = []
        for i in range(num_blocks - 1, -1, -1):
            block = self.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == self.window_blocks:
                return [self.null_block] * i + run[::-1]
        return run[::-1]
