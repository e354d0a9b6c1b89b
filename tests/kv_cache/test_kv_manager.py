import pytest
from kv_fakes import (
    BS,
    FakeRequest,
    check_invariants,
    decode,
    free_ids,
    make_manager,
    ref_cnts,
    snapshot,
)

from kv_cache import KVCacheBlocks, KVCacheManager, PrefixCacheStats


def admit(manager: KVCacheManager, request: FakeRequest) -> KVCacheBlocks | None:
    """What the scheduler does for a waiting request: look up hits, then allocate the rest."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return new_blocks


def test_prefill_allocation():
    manager = make_manager()
    a = FakeRequest("a", list(range(10)), BS)
    hits, num_hit_tokens = manager.get_computed_blocks(a)
    assert hits.get_block_ids() == [[]] and num_hit_tokens == 0
    new_blocks = manager.allocate_slots(a, 10)
    assert new_blocks.get_block_ids() == [[1, 2, 3]]
    assert manager.get_block_ids("a") == [[1, 2, 3]]
    assert ref_cnts(manager.block_pool, [1, 2, 3]) == [1, 1, 1]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9]
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2, 3)] == a.block_hashes + [None]
    assert set(pool.cached_block_hash_to_block) == {(h, 0) for h in a.block_hashes}
    assert manager.usage == pytest.approx(3 / 9)


def test_shared_prefix_gets_cache_hits():
    manager = make_manager()
    a = FakeRequest("a", list(range(10)), BS)
    admit(manager, a)
    b = FakeRequest("b", list(range(8)) + [50, 51, 52], BS)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits.get_block_ids() == [[1, 2]] and num_hit_tokens == 8
    new_blocks = manager.allocate_slots(b, 3, num_hit_tokens, hits)
    assert new_blocks.get_block_ids() == [[4]]
    assert manager.get_block_ids("b") == [[1, 2, 4]]
    assert ref_cnts(manager.block_pool, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert free_ids(manager) == [5, 6, 7, 8, 9]
    assert manager.make_prefix_cache_stats() == PrefixCacheStats(requests=2, queries=21, hits=8)
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()
    b.num_computed_tokens = 11
    check_invariants(manager, {"a": a, "b": b})


def test_decode_growth_appends_a_block_when_one_fills():
    manager = make_manager()
    a = FakeRequest("a", list(range(10)), BS)
    admit(manager, a)
    assert decode(manager, a, 100).get_block_ids() == [[]]
    assert manager.block_pool.blocks[3].block_hash is None
    assert decode(manager, a, 101).get_block_ids() == [[]]
    assert manager.block_pool.blocks[3].block_hash == a.block_hashes[2]
    assert decode(manager, a, 102).get_block_ids() == [[4]]
    assert manager.get_block_ids("a") == [[1, 2, 3, 4]]
    assert free_ids(manager) == [5, 6, 7, 8, 9]


def test_lookahead_slots_are_allocated_but_not_cached():
    manager = make_manager()
    a = FakeRequest("a", list(range(4)), BS)
    assert manager.allocate_slots(a, 4, num_lookahead_tokens=5).get_block_ids() == [[1, 2, 3]]
    assert [manager.block_pool.blocks[i].block_hash for i in (1, 2, 3)] == [
        a.block_hashes[0],
        None,
        None,
    ]


def test_chunked_prefill_caches_only_the_scheduled_chunk():
    manager = make_manager()
    a = FakeRequest("a", list(range(16)), BS)
    assert manager.allocate_slots(a, 4, num_lookahead_tokens=4).get_block_ids() == [[1, 2]]
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2)] == [a.block_hashes[0], None]
    a.num_computed_tokens = 4
    assert manager.allocate_slots(a, 8).get_block_ids() == [[3]]
    assert [pool.blocks[i].block_hash for i in (1, 2, 3)] == a.block_hashes[:3]


def test_allocation_is_capped_by_max_model_len():
    manager = KVCacheManager(10, BS, max_model_len=8)
    a = FakeRequest("a", list(range(6)), BS)
    assert manager.allocate_slots(a, 6, num_lookahead_tokens=10).get_block_ids() == [[1, 2]]


def test_free_evicts_the_request_tail_first():
    manager = make_manager()
    a = FakeRequest("a", list(range(12)), BS)
    admit(manager, a)
    b = FakeRequest("b", list(range(100, 108)), BS)
    admit(manager, b)
    assert manager.get_block_ids("a") == [[1, 2, 3]] and manager.get_block_ids("b") == [[4, 5]]
    manager.free(a)
    assert free_ids(manager) == [6, 7, 8, 9, 3, 2, 1]
    manager.free(b)
    assert free_ids(manager) == [6, 7, 8, 9, 3, 2, 1, 5, 4]
    # Never-used blocks go first, then a's tail, then (LRU) b's blocks.
    c = FakeRequest("c", list(range(200, 228)), BS)
    assert admit(manager, c).get_block_ids() == [[6, 7, 8, 9, 3, 2, 1]]
    assert all(manager.block_pool.get_cached_block(h, 0) is None for h in a.block_hashes)
    assert free_ids(manager) == [5, 4]
    hits, num_hit_tokens = manager.get_computed_blocks(FakeRequest("b2", list(range(100, 109)), BS))
    assert hits.get_block_ids() == [[4, 5]] and num_hit_tokens == 8


def test_hits_on_freed_blocks_leave_the_free_queue():
    manager = make_manager()
    a = FakeRequest("a", list(range(10)), BS)
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert all(manager.block_pool.blocks[i].ref_cnt == 0 for i in range(10))
    a2 = FakeRequest("a2", list(range(10)), BS)
    assert admit(manager, a2).get_block_ids() == [[4]]
    assert manager.get_block_ids("a2") == [[1, 2, 4]]
    assert ref_cnts(manager.block_pool, [1, 2, 3]) == [1, 1, 0]
    assert free_ids(manager) == [5, 6, 7, 8, 9, 3]
    check_invariants(manager, {"a2": a2})


@pytest.mark.parametrize(
    ("num_tokens", "expected_hits"), [(8, [1]), (9, [1, 2]), (12, [1, 2]), (13, [1, 2, 3])]
)
def test_last_token_is_never_served_from_cache(num_tokens, expected_hits):
    manager = make_manager()
    admit(manager, FakeRequest("a", list(range(16)), BS))
    b = FakeRequest("b", list(range(num_tokens)), BS)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits.get_block_ids() == [expected_hits]
    assert num_hit_tokens == len(expected_hits) * BS == (num_tokens - 1) // BS * BS


def test_failed_allocation_returns_none_and_changes_nothing():
    manager = make_manager(num_blocks=6)
    a = FakeRequest("a", list(range(8)), BS)
    admit(manager, a)
    manager.free(a)
    c = FakeRequest("c", list(range(100, 112)), BS)
    admit(manager, c)
    assert manager.get_block_ids("c") == [[3, 4, 5]] and free_ids(manager) == [2, 1]
    # Both hits sit in the free queue: touching them uses up the free capacity.
    a2 = FakeRequest("a2", list(range(9)), BS)
    hits, num_hit_tokens = manager.get_computed_blocks(a2)
    assert hits.get_block_ids() == [[1, 2]]
    before = snapshot(manager)
    assert manager.allocate_slots(a2, 1, num_hit_tokens, hits) is None
    assert snapshot(manager) == before
    assert manager.allocate_slots(FakeRequest("d", [1] * 9, BS), 9) is None
    assert snapshot(manager) == before
    assert manager.allocate_slots(c, 9) is None
    assert snapshot(manager) == before
    manager.free(c)
    assert free_ids(manager) == [2, 1, 5, 4, 3]
    assert manager.allocate_slots(a2, 1, num_hit_tokens, hits).get_block_ids() == [[5]]
    assert manager.get_block_ids("a2") == [[1, 2, 5]] and free_ids(manager) == [4, 3]


def test_allocation_that_exactly_fits_succeeds():
    manager = make_manager(num_blocks=4)
    a = FakeRequest("a", list(range(12)), BS)
    assert manager.allocate_slots(a, 12).get_block_ids() == [[1, 2, 3]]
    assert manager.block_pool.get_num_free_blocks() == 0
    a.num_computed_tokens = 12
    a.append_token(0)
    assert manager.allocate_slots(a, 1) is None


def test_cache_salt_isolates_prefixes():
    manager = make_manager()
    admit(manager, FakeRequest("a", list(range(9)), BS, cache_salt="alice"))
    assert manager.get_computed_blocks(FakeRequest("b", list(range(9)), BS))[1] == 0
    bob = FakeRequest("c", list(range(9)), BS, cache_salt="bob")
    assert manager.get_computed_blocks(bob)[1] == 0
    alice = FakeRequest("d", list(range(9)), BS, cache_salt="alice")
    assert manager.get_computed_blocks(alice)[0].get_block_ids() == [[1, 2]]


def test_same_block_tokens_after_different_prefix_miss():
    manager = make_manager()
    admit(manager, FakeRequest("a", [1, 1, 1, 1, 7, 7, 7, 7, 0], BS))
    hits, num_hit_tokens = manager.get_computed_blocks(
        FakeRequest("b", [2, 2, 2, 2, 7, 7, 7, 7, 0], BS)
    )
    assert hits.get_block_ids() == [[]] and num_hit_tokens == 0


def test_reset_prefix_cache():
    manager = make_manager()
    a = FakeRequest("a", list(range(9)), BS)
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.get_computed_blocks(FakeRequest("b", list(range(9)), BS))[1] == 0


def test_caching_disabled_never_hashes_or_hits():
    manager = make_manager(enable_caching=False)
    a = FakeRequest("a", list(range(9)), BS)
    assert admit(manager, a).get_block_ids() == [[1, 2, 3]]
    b = FakeRequest("b", list(range(9)), BS)
    assert manager.get_computed_blocks(b) == (KVCacheBlocks.empty(1), 0)
    assert all(blk.block_hash is None for blk in manager.block_pool.blocks)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()
    manager.free(a)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_kv_cache_blocks_helpers():
    manager = make_manager()
    blocks = manager.block_pool.blocks
    assert KVCacheBlocks(([blocks[3], blocks[1]],)).get_block_ids() == [[3, 1]]
    with pytest.raises(TypeError):
        KVCacheBlocks([blocks[3], blocks[1]])
    assert KVCacheBlocks.empty(1).get_block_ids() == [[]]
    assert manager.get_block_ids("unknown") == [[]]
    with pytest.raises(ValueError):
        manager.allocate_slots(FakeRequest("a", [1], BS), 0)


def test_everything_freed_returns_all_blocks():
    manager = make_manager()
    requests = [FakeRequest(f"r{i}", [i % 2] * (5 + i), BS) for i in range(3)]
    for request in requests:
        admit(manager, request)
    for request in requests:
        manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 9
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_blocks_cached_for_tokens_never_computed_lose_their_hashes_on_free():
    """A request preempted in the step that scheduled its tokens (the priority policy can
    pick one scheduled earlier in the step): the blocks allocate_slots cached for those
    tokens hold no KV, so freeing it uncaches them; its computed blocks stay cached."""
    manager = make_manager()
    a = FakeRequest("a", list(range(14)), BS)
    manager.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    assert manager.allocate_slots(a, 10).get_block_ids() == [[2, 3, 4]]
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2, 3, 4)] == a.block_hashes + [None]
    manager.free(a)  # before the step ran: 4 tokens computed
    assert [pool.blocks[i].block_hash for i in (1, 2, 3, 4)] == [
        a.block_hashes[0],
        None,
        None,
        None,
    ]
    assert free_ids(manager) == [5, 6, 7, 8, 9, 4, 3, 2, 1]
    hits, num_hit_tokens = manager.get_computed_blocks(FakeRequest("b", list(range(14)), BS))
    assert hits.get_block_ids() == [[1]] and num_hit_tokens == 4
    check_invariants(manager, {})


def test_a_finished_request_keeps_every_computed_block_cached():
    manager = make_manager()
    a = FakeRequest("a", list(range(14)), BS)
    admit(manager, a)
    manager.free(a)
    hits, num_hit_tokens = manager.get_computed_blocks(FakeRequest("b", list(range(14)), BS))
    assert hits.get_block_ids() == [[1, 2, 3]] and num_hit_tokens == 12
