"""Test helpers: a minimal request, a manager and the scheduler's steps on it, and
whole-pool snapshots / invariant checks."""

from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise

from kv_cache import KVCacheBlocks, KVCacheManager, extend_block_hashes

BS = 4  # tokens per block


@dataclass
class FakeRequest:
    request_id: str
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self._rehash()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._rehash()

    def _rehash(self) -> None:
        extend_block_hashes(self.block_hashes, self.token_ids, self.block_size, self.cache_salt)


def make_manager(num_blocks: int = 10, **kwargs) -> KVCacheManager:
    """A manager of `num_blocks` blocks of BS tokens, for requests of up to 200."""
    return KVCacheManager(num_blocks, BS, max_model_len=200, **kwargs)


def prefill(manager: KVCacheManager, request: FakeRequest) -> KVCacheBlocks:
    """Admit a waiting request that fits: its prefix hits, then new blocks for the rest;
    the whole prompt is computed. The request's blocks, hits first."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    assert new_blocks is not None, f"{request.request_id} does not fit"
    request.num_computed_tokens = request.num_tokens
    return hits + new_blocks


def decode(manager: KVCacheManager, request: FakeRequest, token_id: int) -> KVCacheBlocks | None:
    """One decode step: the sampled token arrives, then a slot is allocated for it."""
    request.append_token(token_id)
    new_blocks = manager.allocate_slots(request, 1)
    if new_blocks is not None:
        request.num_computed_tokens += 1
    return new_blocks


def ref_cnts(pool, block_ids: list[int]) -> list[int]:
    return [pool.blocks[i].ref_cnt for i in block_ids]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def snapshot(manager: KVCacheManager) -> tuple:
    """Everything observable about the pool and the block tables."""
    pool = manager.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.cache_key) for b in pool.blocks],
        free_ids(manager),
        {key: sorted(d) for key, d in pool.cached_block_hash_to_block.items()},
        [
            (
                {r: ids(bs) for r, bs in stm.req_to_blocks.items() if bs},
                {r: n for r, n in stm.num_cached_block.items() if n},
            )
            for stm in manager.single_type_managers
        ],
    )


def check_invariants(manager: KVCacheManager, requests: dict[str, FakeRequest]) -> None:
    pool = manager.block_pool
    queue = pool.free_block_queue
    free = queue.get_all_free_blocks()

    assert len(free) == queue.num_free_blocks == pool.get_num_free_blocks()
    assert len({b.block_id for b in free}) == len(free)
    for prev, block in pairwise(free):
        assert prev.next_free_block is block and block.prev_free_block is prev
    if free:
        assert free[0].prev_free_block.block_id == -1
        assert free[-1].next_free_block.block_id == -1

    null = pool.null_block
    assert null is pool.blocks[0] and null.is_null and null.ref_cnt == 0
    assert null.block_hash is None and null.prev_free_block is None

    # A live block belongs to one group, and sits at most once in each request's table.
    group_of: dict[int, int] = {}
    holders: Counter[int] = Counter()
    for group_id, stm in enumerate(manager.single_type_managers):
        assert stm.group_id == group_id
        assert {r for r, bs in stm.req_to_blocks.items() if bs} <= set(requests)
        for blocks in stm.req_to_blocks.values():
            live = [b.block_id for b in blocks if not b.is_null]
            assert len(set(live)) == len(live)
            holders.update(live)
            for block_id in live:
                assert group_of.setdefault(block_id, group_id) == group_id
    free_set = {b.block_id for b in free}
    for block in pool.blocks[1:]:
        assert not block.is_null
        if holders[block.block_id] == 0:
            assert block.ref_cnt == 0 and block.block_id in free_set
        else:
            assert block.ref_cnt == holders[block.block_id]
            assert block.block_id not in free_set and block.next_free_block is None

    # The cache maps (hash, group) to blocks of that group carrying exactly that key.
    cache = pool.cached_block_hash_to_block
    if not manager.enable_caching:
        assert not cache
    num_hashed = sum(b.cache_key is not None for b in pool.blocks)
    assert num_hashed == sum(len(d) for d in cache.values())
    for (block_hash, group_id), same_key in cache.items():
        assert same_key and 0 <= group_id < manager.num_groups
        for block_id, block in same_key.items():
            assert block.block_id == block_id and block.cache_key == (block_hash, group_id)
            assert group_of.get(block_id, group_id) == group_id
        assert pool.get_cached_block(block_hash, group_id) in same_key.values()

    for group_id, stm in enumerate(manager.single_type_managers):
        window = manager.group_windows[group_id]
        for request_id, blocks in stm.req_to_blocks.items():
            request = requests[request_id]
            assert len(blocks) * manager.block_size >= request.num_computed_tokens
            if window is not None:  # the next token's window must be intact
                first_needed = max(0, request.num_computed_tokens - window + 1)
                assert not any(b.is_null for b in blocks[first_needed // manager.block_size :])
            else:
                assert not any(b.is_null for b in blocks)
            num_cached = stm.num_cached_block.get(request_id, 0)
            assert num_cached * manager.block_size <= request.num_computed_tokens  # computed KV
            for i, block in enumerate(blocks):
                if block.is_null:
                    continue
                if i < num_cached:
                    assert block.cache_key == (request.block_hashes[i], group_id)
                else:
                    assert block.cache_key is None

    # Every group holds a block-table entry for every position of a request.
    for request_id in requests:
        lengths = {
            len(stm.req_to_blocks.get(request_id, ())) for stm in manager.single_type_managers
        }
        assert len(lengths) == 1

    assert abs(manager.usage - (1 - len(free) / (pool.num_blocks - 1))) < 1e-9
