"""Paged KV cache management for the EngineCore: blocks, prefix caching, allocation."""

from kv_cache.block import BlockHashWithGroupId, KVCacheBlock
from kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from kv_cache.free_queue import FreeKVCacheBlockQueue
from kv_cache.hashing import NONE_HASH, block_hashes, extend_block_hashes, hash_block_tokens
from kv_cache.host_tier import BlockCopy, HostTier, SwappedRequest
from kv_cache.kv_cache_blocks import KVCacheBlocks
from kv_cache.manager import KVCacheManager, PrefixCacheStats
from kv_cache.request import KVCacheRequest
from kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)

__all__ = [
    "NONE_HASH",
    "NULL_BLOCK_ID",
    "BlockCopy",
    "BlockHashWithGroupId",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "HostTier",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVCacheRequest",
    "PrefixCacheStats",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SwappedRequest",
    "block_hashes",
    "extend_block_hashes",
    "hash_block_tokens",
]
