"""The scheduler's cumulative counters, and the SchedulerStats made from them."""

from __future__ import annotations

import bisect

from ipc.config import EngineConfig
from ipc.messages import ITERATION_TOKEN_BUCKETS, SchedulerStats
from kv_cache import KVCacheManager


def cache_config_info(config: EngineConfig, kv_cache_manager: KVCacheManager) -> dict[str, str]:
    """The labels of vLLM's cache_config_info metric (its CacheConfig's fields, as strings)
    that this engine has: the KV cache as the workers allocated it. num_cpu_blocks is the
    host tier's."""
    host = kv_cache_manager.host_block_pool
    fields = {
        "block_size": config.block_size,
        "cache_dtype": config.kv_cache_dtype,
        "enable_prefix_caching": config.enable_prefix_caching,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "kv_cache_memory_bytes": config.kv_cache_memory,
        "num_cpu_blocks": 0 if host is None else host.num_blocks,
        "num_gpu_blocks": kv_cache_manager.block_pool.num_blocks,
        "num_gpu_blocks_override": config.num_gpu_blocks_override,
    }
    return {name: str(value) for name, value in fields.items()}


class SchedulerCounters:
    """Counts since start: preemptions, prompt and generated tokens, each step's scheduled
    tokens (by ITERATION_TOKEN_BUCKETS, and their sum) and the prefix cache's lookups; and
    the fixed cache_config_info labels every SchedulerStats carries."""

    def __init__(self, cache_config_info: dict[str, str] | None = None) -> None:
        self.cache_config_info = cache_config_info or {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_cache_hits = 0

    def count_step(self, num_tokens: int) -> None:
        """A step that schedules `num_tokens` tokens (none: not a step)."""
        if num_tokens:
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
            self.iteration_tokens_sum += num_tokens

    def make_stats(
        self, kv_cache_manager: KVCacheManager, num_running: int, num_waiting: int
    ) -> SchedulerStats:
        """The counters, and the current queue sizes and KV usage."""
        prefix_stats = kv_cache_manager.make_prefix_cache_stats()
        self.prefix_cache_queries += prefix_stats.queries
        self.prefix_cache_hits += prefix_stats.hits
        self.host_cache_hits += prefix_stats.host_hits
        return SchedulerStats(
            num_running=num_running,
            num_waiting=num_waiting,
            kv_cache_usage=kv_cache_manager.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_swapped_out_blocks=kv_cache_manager.num_swapped_out_blocks,
            num_swapped_in_blocks=kv_cache_manager.num_swapped_in_blocks,
            num_spilled_blocks=kv_cache_manager.num_spilled_blocks,
            host_cache_hits=self.host_cache_hits,
            iteration_tokens=list(self.iteration_tokens),
            iteration_tokens_sum=self.iteration_tokens_sum,
            cache_config_info=self.cache_config_info,
        )
