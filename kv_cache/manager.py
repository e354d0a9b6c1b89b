"""KVCacheManager: the scheduler's view of the paged KV cache, over one or more groups."""

from collections.abc import Sequence
from dataclasses import dataclass

from kv_cache.block import KVCacheBlock
from kv_cache.block_pool import BlockPool
from kv_cache.host_tier import BlockCopy, HostTier
from kv_cache.kv_cache_blocks import KVCacheBlocks, tail_first
from kv_cache.request import KVCacheRequest
from kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)


@dataclass
class PrefixCacheStats:
    """Prefix cache lookups since the last make_prefix_cache_stats(), counted in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    # Hit tokens served by host-tier blocks (also counted in hits).
    host_hits: int = 0


class KVCacheManager:
    """One SingleTypeKVCacheManager per KV cache group over one BlockPool.

    `group_windows` has one entry per group: None for full attention, W for a sliding
    window of W tokens. Without it the model has one group whose window is
    `sliding_window`. Each group holds its own blocks for every request; a request's block
    lists have the same length in every group.

    With `num_host_blocks` > 0 a host tier (HostTier) backs the device pool: swap
    preemption, spilling of evicted cached blocks, and prefix hits served from the host.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        group_windows: Sequence[int | None] | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        if group_windows is None:
            group_windows = (sliding_window,)
        elif sliding_window is not None:
            raise ValueError("pass either sliding_window or group_windows, not both")
        if not group_windows:
            raise ValueError("group_windows needs at least one KV cache group")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            FullAttentionManager(self.block_pool, block_size, group_id)
            if window is None
            else SlidingWindowManager(self.block_pool, block_size, group_id, window)
            for group_id, window in enumerate(self.group_windows)
        )
        self.full_managers = tuple(
            m for m in self.single_type_managers if isinstance(m, FullAttentionManager)
        )
        self.window_managers = tuple(
            m for m in self.single_type_managers if isinstance(m, SlidingWindowManager)
        )
        self._no_hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in self.group_windows)
        self._no_new_blocks = KVCacheBlocks(tuple([] for _ in self.group_windows))  # read only
        self.prefix_cache_stats = PrefixCacheStats()
        self.host_tier = (
            HostTier(num_host_blocks, self.block_pool, block_size) if num_host_blocks else None
        )
        self.host_block_pool = None if self.host_tier is None else self.host_tier.pool
        if self.host_tier is not None and enable_caching:
            for manager in self.single_type_managers:
                manager.get_cached_block = self._get_cached_block_in_either_tier

    @property
    def has_host_tier(self) -> bool:
        return self.host_tier is not None

    @property
    def host_usage(self) -> float:
        return 0.0 if self.host_block_pool is None else self.host_block_pool.get_usage()

    @property
    def num_swapped_out_blocks(self) -> int:
        return 0 if self.host_tier is None else self.host_tier.num_swapped_out_blocks

    @property
    def num_swapped_in_blocks(self) -> int:
        return 0 if self.host_tier is None else self.host_tier.num_swapped_in_blocks

    @property
    def num_spilled_blocks(self) -> int:
        return 0 if self.host_tier is None else self.host_tier.num_spilled_blocks

    def _get_cached_block_in_either_tier(
        self, block_hash: bytes, group_id: int
    ) -> KVCacheBlock | None:
        block = self.block_pool.get_cached_block(block_hash, group_id)
        if block is None:
            block = self.host_tier.get_cached_block(block_hash, group_id)
        return block

    @property
    def num_groups(self) -> int:
        return len(self.single_type_managers)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of whole blocks that every group can serve. At most
        num_tokens - 1 tokens hit: the last token is always recomputed so the model produces
        its logits."""
        if not self.enable_caching:
            return KVCacheBlocks.empty(self.num_groups), 0
        hits, num_hit_tokens = self._find_common_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        if self.host_tier is not None and num_hit_tokens:
            num_host_positions = sum(
                1 for position in zip(*hits, strict=True) if any(b.is_host for b in position)
            )
            self.prefix_cache_stats.host_hits += num_host_positions * self.block_size
        return KVCacheBlocks(hits), num_hit_tokens

    def _find_common_cache_hit(
        self, block_hashes: list[bytes], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """A full-attention group accepts every length up to its leading run of hits; a
        sliding group accepts a length only when the window before it is cached, and answers
        the longest such length up to the one it is asked. Shrink the length until every
        group accepts it: then it is the longest length all groups accept."""
        hits: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        length = max_length // self.block_size * self.block_size
        for manager in self.full_managers:
            hits[manager.group_id] = manager.find_longest_cache_hit(block_hashes, length)
            length = min(length, len(hits[manager.group_id]) * self.block_size)
        shrunk = True
        while shrunk and length > 0:
            shrunk = False
            for manager in self.window_managers:
                hits[manager.group_id] = manager.find_longest_cache_hit(block_hashes, length)
                num_tokens = len(hits[manager.group_id]) * self.block_size
                shrunk |= num_tokens < length
                length = min(length, num_tokens)
        num_blocks = length // self.block_size
        return tuple(group_hits[:num_blocks] for group_hits in hits), length

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room in every group for `num_new_tokens` more tokens, after the request's
        computed tokens and the cache hits from get_computed_blocks (plus lookahead slots
        for draft tokens). With `delay_cache_blocks` the blocks those tokens fill are not
        cached now (their KV arrives later, from a KV connector): cache_blocks does it.

        Returns only the newly allocated blocks. Returns None when the free blocks do not
        suffice for all groups together; then nothing has been allocated or touched. (Before
        that check sliding groups release the blocks that fell out of the window, which the
        request never reads again.)

        The computed blocks may be host blocks (host-tier hits, or a swapped request's
        blocks from get_swapped_blocks, with `num_new_computed_tokens` the tokens they
        hold): each is copied into a new device block in this step's swap-ins.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be greater than 0")
        if new_computed_blocks is None and not num_lookahead_tokens and not self.window_managers:
            in_place = self._allocate_in_place(request, num_new_tokens)
            if in_place is not None:
                return in_place
        managers = self.single_type_managers
        if new_computed_blocks is None:
            hits = self._no_hits
        elif self.host_tier is None:
            hits = new_computed_blocks.blocks
        else:
            hits = self.host_tier.resolve_held_hits(new_computed_blocks.blocks)
        if len(hits) != len(managers):
            raise ValueError(f"got cache hits of {len(hits)} groups, the model has {len(managers)}")
        request_id = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        for manager in self.window_managers:
            manager.remove_skipped_blocks(request_id, num_computed)
        num_to_allocate = 0
        for manager, group_hits in zip(managers, hits, strict=True):
            num_to_allocate += manager.get_num_blocks_to_allocate(
                request_id, num_needed, group_hits
            )
        if num_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        # Every group's hits are taken before any new block is popped, so no new block can
        # evict a hit.
        if new_computed_blocks is not None and self.host_tier is None:
            for manager, group_hits in zip(managers, hits, strict=True):
                manager.allocate_new_computed_blocks(request_id, group_hits)
        elif new_computed_blocks is not None:
            self.host_tier.take_hits(request, hits, num_new_computed_tokens, managers)
        new_blocks = tuple(
            [manager.allocate_new_blocks(request_id, num_needed) for manager in managers]
        )
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Cache the request's full blocks among its first `num_tokens` tokens, in every
        group (blocks cached already stay as they are)."""
        if self.enable_caching:
            for manager in self.single_type_managers:
                manager.cache_blocks(request, num_tokens)

    def _allocate_in_place(
        self, request: KVCacheRequest, num_new_tokens: int
    ) -> KVCacheBlocks | None:
        """The decode case, with full attention only: when the request's blocks already
        have room for the new tokens, nothing is allocated; the blocks they fill are
        cached. None when a block is needed (the general path then runs)."""
        request_id = request.request_id
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = min(num_tokens, self.max_model_len)
        for manager in self.single_type_managers:
            if num_needed > len(manager.req_to_blocks.get(request_id, ())) * self.block_size:
                return None
        if self.enable_caching:
            num_cacheable = min(num_tokens, request.num_tokens)
            for manager in self.single_type_managers:
                manager.cache_blocks(request, num_cacheable)
        return self._no_new_blocks

    def free(self, request: KVCacheRequest) -> None:
        """Free from the tail, position by position across the groups, so the request's tail
        is evicted before its (more shareable) head in every group. A swapped request's host
        blocks are freed the same way. Blocks cached for tokens past its computed ones
        (scheduled in this step, which then preempted it) are uncached first."""
        if self.host_tier is not None:
            self.host_tier.free_swapped(request.request_id)
        self._free_device_blocks(request)

    def _free_device_blocks(self, request: KVCacheRequest) -> None:
        request_id = request.request_id
        if self.enable_caching:
            for manager in self.single_type_managers:
                manager.uncache_uncomputed_blocks(request)
        tables = [manager.pop_blocks(request_id) for manager in self.single_type_managers]
        if len(tables) == 1:
            self.block_pool.free_blocks(reversed(tables[0]))
            return
        self.block_pool.free_blocks(tail_first(tables))

    def swap_out(self, request: KVCacheRequest) -> bool:
        """Preempt a running request by copying its KV to the host tier: one host block per
        device block holding computed tokens (of `request.num_computed_tokens`; blocks
        before a sliding window stay null), then free its device blocks as free() does.
        False, with nothing changed, when the host has too few free blocks."""
        if self.host_tier is None:
            raise RuntimeError("swap_out needs a host tier (num_host_blocks > 0)")
        request_id = request.request_id
        num_tokens = request.num_computed_tokens
        num_positions = -(-num_tokens // self.block_size)
        tables = []
        for manager in self.single_type_managers:
            blocks = manager.req_to_blocks.get(request_id, [])[:num_positions]
            num_skipped = manager.get_num_skipped_tokens(num_tokens) // self.block_size
            tables.append([self.block_pool.null_block] * num_skipped + blocks[num_skipped:])
        if not self.host_tier.swap_out(request_id, tables, num_tokens):
            return False
        self._free_device_blocks(request)
        return True

    def is_swapped(self, request_id: str) -> bool:
        return self.host_tier is not None and request_id in self.host_tier.swapped

    def get_swapped_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """A swapped request's host blocks and the number of tokens they hold, to pass to
        allocate_slots when it resumes."""
        if self.host_tier is None:
            raise RuntimeError("no host tier")
        return self.host_tier.get_swapped_blocks(request.request_id)

    def take_block_copies(self) -> tuple[list[BlockCopy], list[BlockCopy]]:
        """This step's (device, host) swap-out copies and (host, device) swap-in copies, in
        order; the host blocks they name are released. Call once per step."""
        if self.host_tier is None:
            return [], []
        return self.host_tier.take_block_copies()

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [
            [block.block_id for block in manager.req_to_blocks.get(request_id, ())]
            for manager in self.single_type_managers
        ]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, of both tiers. False while any block is in use."""
        if self.host_block_pool is None:
            return self.block_pool.reset_prefix_cache()
        pools = (self.block_pool, self.host_block_pool)
        if any(pool.get_num_free_blocks() != pool.num_blocks - 1 for pool in pools):
            return False
        return all([pool.reset_prefix_cache() for pool in pools])
