"""KVCacheManager: the scheduler's view of the paged KV cache."""

from dataclasses import dataclass, field

from kv_cache.block import KVCacheBlock
from kv_cache.block_pool import BlockPool
from kv_cache.events import KVCacheEvent
from kv_cache.request import KVCacheRequest
from kv_cache.single_type_manager import FullAttentionManager, SlidingWindowManager


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler (a single KV cache group)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    @classmethod
    def empty(cls) -> "KVCacheBlocks":
        return cls([])

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


@dataclass
class PrefixCacheStats:
    """Prefix cache lookups since the last make_prefix_cache_stats(), counted in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        if sliding_window is None:
            self.single_type_manager = FullAttentionManager(self.block_pool, block_size)
        else:
            self.single_type_manager = SlidingWindowManager(
                self.block_pool, block_size, sliding_window
            )
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of whole blocks. At most num_tokens - 1 tokens hit: the last
        token is always recomputed so the model produces its logits."""
        if not self.enable_caching:
            return KVCacheBlocks.empty(), 0
        hits = self.single_type_manager.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens, after the request's computed tokens and
        the cache hits from get_computed_blocks (plus lookahead slots for draft tokens).

        Returns only the newly allocated blocks. Returns None when the free blocks do not
        suffice; then nothing has been allocated or touched. (Before that check a sliding
        window releases the blocks that fell out of it, which the request never reads again.)
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be greater than 0")
        manager = self.single_type_manager
        request_id = request.request_id
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        manager.remove_skipped_blocks(request_id, num_computed)
        num_to_allocate = manager.get_num_blocks_to_allocate(request_id, num_needed, hits)
        if num_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        # Hits leave the free queue before new blocks are popped, so they cannot be evicted.
        manager.allocate_new_computed_blocks(request_id, hits)
        new_blocks = manager.allocate_new_blocks(request_id, num_needed)
        if self.enable_caching:
            manager.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def free(self, request: KVCacheRequest) -> None:
        self.single_type_manager.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [
            block.block_id for block in self.single_type_manager.req_to_blocks.get(request_id, ())
        ]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()
