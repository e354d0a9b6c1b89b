"""The host tier: a second BlockPool of host blocks (pinned CPU memory on the workers).

The manager decides and records block copies; the workers make them. Each step's copies
are taken once (take_block_copies) and run in this order: every swap-out (device -> host),
then every swap-in (host -> device), then the forward. So within one step no host block
may appear in two copies: every host block named in a copy is held (one reference) until
the copies are taken, and a held host block is never a prefix-cache hit.
"""

from dataclasses import dataclass

from kv_cache.block import KVCacheBlock
from kv_cache.block_pool import BlockPool
from kv_cache.kv_cache_blocks import KVCacheBlocks, tail_first
from kv_cache.request import KVCacheRequest
from kv_cache.single_type_manager import SingleTypeKVCacheManager

BlockCopy = tuple[int, int]  # (source block id, destination block id)


@dataclass
class SwappedRequest:
    """Host blocks of a swapped-out request, per group (null where the device held null),
    and the number of tokens whose KV they hold."""

    tables: tuple[list[KVCacheBlock], ...]
    num_tokens: int


class HostTier:
    def __init__(self, num_blocks: int, device_pool: BlockPool, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, device_pool.enable_caching, is_host=True)
        self.device_pool = device_pool
        self.block_size = block_size
        self.swapped: dict[str, SwappedRequest] = {}
        self.swap_out_copies: list[BlockCopy] = []
        self.swap_in_copies: list[BlockCopy] = []
        self._step_holds: list[KVCacheBlock] = []
        self._held_ids: set[int] = set()
        # This step's copies by device block id, so a device block is a copy source once.
        self._swap_out_dest: dict[int, KVCacheBlock] = {}
        self._swap_in_source: dict[int, KVCacheBlock] = {}
        self._swapped_this_step: set[str] = set()
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_spilled_blocks = 0
        if device_pool.enable_caching:
            device_pool.on_last_copy_evicted = self._spill

    def get_cached_block(self, block_hash: bytes, group_id: int) -> KVCacheBlock | None:
        """A host block caching the key that no copy of this step names, or None."""
        same_key = self.pool.cached_block_hash_to_block.get((block_hash, group_id))
        if same_key:
            for block in same_key.values():
                if block.block_id not in self._held_ids:
                    return block
        return None

    def _hold(self, block: KVCacheBlock) -> None:
        """Register a reference the caller took as held until the copies are taken."""
        self._step_holds.append(block)
        self._held_ids.add(block.block_id)

    def _spill(self, device_block: KVCacheBlock) -> None:
        """Copy a device block losing the last device copy of its key to the host, unless the
        host caches the key already or has no free block."""
        cache_key = device_block.cache_key
        pool = self.pool
        if cache_key in pool.cached_block_hash_to_block or not pool.get_num_free_blocks():
            return
        (host_block,) = pool.get_new_blocks(1)
        pool.cache_block(host_block, cache_key)
        self._hold(host_block)
        self.swap_out_copies.append((device_block.block_id, host_block.block_id))
        self.num_spilled_blocks += 1

    def swap_out(self, request_id: str, tables: list[list[KVCacheBlock]], num_tokens: int) -> bool:
        """Copy the request's device blocks (`tables`, per group, null where nothing is kept)
        to host blocks. A full block's host copy gets its cache key. False, with nothing
        changed, when the host has fewer free blocks than device blocks to copy."""
        num_to_copy = sum(1 for blocks in tables for block in blocks if not block.is_null)
        if num_to_copy > self.pool.get_num_free_blocks():
            return False
        num_full = num_tokens // self.block_size
        null_block = self.device_pool.null_block
        host_tables = tuple([null_block] * len(blocks) for blocks in tables)
        for blocks, host_blocks in zip(tables, host_tables, strict=True):
            for i, device_block in enumerate(blocks):
                if not device_block.is_null:
                    host_blocks[i] = self._copy_out(device_block, i < num_full)
        self.swapped[request_id] = SwappedRequest(host_tables, num_tokens)
        self._swapped_this_step.add(request_id)
        return True

    def _copy_out(self, device_block: KVCacheBlock, is_full: bool) -> KVCacheBlock:
        """One host block holding the device block's content after this step's copies, with a
        reference for the swapped request."""
        block_id = device_block.block_id
        host_block = self._swap_in_source.get(block_id) or self._swap_out_dest.get(block_id)
        if host_block is not None:  # it gets (or already has) this content this step
            self.pool.touch((host_block,))
            return host_block
        (host_block,) = self.pool.get_new_blocks(1)
        self.pool.touch((host_block,))
        self._hold(host_block)
        if is_full and device_block.cache_key is not None:
            self.pool.cache_block(host_block, device_block.cache_key)
        self.swap_out_copies.append((block_id, host_block.block_id))
        self._swap_out_dest[block_id] = host_block
        self.num_swapped_out_blocks += 1
        return host_block

    def get_swapped_blocks(self, request_id: str) -> tuple[KVCacheBlocks, int]:
        if request_id in self._swapped_this_step:
            raise ValueError(f"request {request_id} was swapped out this step; resume it later")
        entry = self.swapped[request_id]
        return KVCacheBlocks(tuple(list(blocks) for blocks in entry.tables)), entry.num_tokens

    def resolve_held_hits(
        self, hits: tuple[list[KVCacheBlock], ...]
    ) -> tuple[list[KVCacheBlock], ...]:
        """Replace each host hit already copied to the device this step by a device block
        caching its key (copying it again would name it twice in this step)."""
        if not self._held_ids:
            return hits
        get_device_block = self.device_pool.get_cached_block
        resolved = []
        for group_hits in hits:
            group_resolved = list(group_hits)
            for i, block in enumerate(group_hits):
                if block.is_host and block.block_id in self._held_ids and block.cache_key:
                    group_resolved[i] = get_device_block(*block.cache_key) or block
            resolved.append(group_resolved)
        return tuple(resolved)

    def take_hits(
        self,
        request: KVCacheRequest,
        hits: tuple[list[KVCacheBlock], ...],
        num_new_computed_tokens: int,
        single_type_managers: tuple[SingleTypeKVCacheManager, ...],
    ) -> None:
        """Start the request's block lists with its hits: take the device hits, then copy
        each host hit into a new device block, which gets the host block's cache key. Every
        hit is held before any device block is popped (a popped block may spill to the host).
        A resumed request's swap entry is dropped."""
        device_pool = self.device_pool
        device_pool.touch(b for group_hits in hits for b in group_hits if not b.is_host)
        host_hits = [
            (group_id, i, block)
            for group_id, group_hits in enumerate(hits)
            for i, block in enumerate(group_hits)
            if block.is_host
        ]
        self.pool.touch(block for _, _, block in host_hits)
        for _, _, block in host_hits:
            self._hold(block)
        tables = [list(group_hits) for group_hits in hits]
        device_blocks = device_pool.get_new_blocks(len(host_hits))
        for (group_id, i, host_block), device_block in zip(host_hits, device_blocks, strict=True):
            tables[group_id][i] = device_block
            self.swap_in_copies.append((host_block.block_id, device_block.block_id))
            self._swap_in_source[device_block.block_id] = host_block
            if host_block.cache_key is not None:
                device_pool.cache_block(device_block, host_block.cache_key)
        self.num_swapped_in_blocks += len(host_hits)
        # A partial last block (of a swapped request) is cached once it fills.
        num_cached = num_new_computed_tokens // self.block_size if self.pool.enable_caching else 0
        for manager, blocks in zip(single_type_managers, tables, strict=True):
            manager.set_computed_blocks(request.request_id, blocks, num_cached)
        self._drop_swapped(request.request_id)

    def _drop_swapped(self, request_id: str) -> None:
        """A swapped request resumed: its host references are released with this step's
        copies."""
        entry = self.swapped.pop(request_id, None)
        if entry is not None:
            for block in tail_first(entry.tables):
                if not block.is_null:
                    self._hold(block)

    def free_swapped(self, request_id: str) -> None:
        """A swapped request ended: release its host blocks, tail first."""
        entry = self.swapped.pop(request_id, None)
        if entry is not None:
            self.pool.free_blocks(tail_first(entry.tables))

    def take_block_copies(self) -> tuple[list[BlockCopy], list[BlockCopy]]:
        copies = (self.swap_out_copies, self.swap_in_copies)
        self.swap_out_copies, self.swap_in_copies = [], []
        holds, self._step_holds = self._step_holds, []
        self._held_ids.clear()
        self._swap_out_dest.clear()
        self._swap_in_source.clear()
        self._swapped_this_step.clear()
        self.pool.free_blocks(holds)
        return copies
