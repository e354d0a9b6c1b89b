"""Which running request gives its KV blocks back when the cache is full, and how: swapped
out to the host tier (copied back when it resumes) or freed and recomputed."""

from __future__ import annotations

from engine_core.request import Request
from ipc.config import EngineConfig, PreemptionMode, SchedulingPolicy
from kv_cache import KVCacheManager


class PreemptionPolicy:
    """`block_copy_seconds` (one KV block, one way between the tiers) and
    `prefill_token_seconds` are the workers' measured costs; preemption_mode auto compares
    them to choose between swap and recompute."""

    def __init__(
        self, config: EngineConfig, block_copy_seconds: float, prefill_token_seconds: float
    ) -> None:
        self.by_priority = config.scheduling_policy == SchedulingPolicy.PRIORITY
        self.mode = config.preemption_mode
        self.block_copy_seconds = block_copy_seconds
        self.prefill_token_seconds = prefill_token_seconds

    def victim(self, running: list[Request]) -> Request:
        """FCFS: the latest admitted; priority: the lowest priority, latest arrival."""
        if self.by_priority:
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    def swaps(self, request: Request, kv_cache_manager: KVCacheManager) -> bool:
        """Whether to swap the request's blocks out rather than recompute it: always in
        preemption_mode swap; in auto when copying the blocks out and back costs less than
        prefilling the computed tokens again."""
        if self.mode == PreemptionMode.RECOMPUTE or not kv_cache_manager.has_host_tier:
            return False
        if request.num_computed_tokens == 0:
            return False
        if self.mode == PreemptionMode.SWAP:
            return True
        block_ids = kv_cache_manager.get_block_ids(request.request_id)
        num_blocks = sum(1 for ids in block_ids for i in ids if i)
        swap = 2 * num_blocks * self.block_copy_seconds
        return swap < request.num_computed_tokens * self.prefill_token_seconds
