"""The host tier: exact block ids, ref counts and free queues of both pools for swap
preemption, spilling of evicted cached blocks and host prefix hits."""

import pytest
from kv_fakes import (
    BS,
    FakeRequest,
    check_invariants,
    free_ids,
    ids,
    make_manager,
    prefill,
    ref_cnts,
    snapshot,
)

from kv_cache import KVCacheBlocks, KVCacheManager, PrefixCacheStats


def host_free_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.host_block_pool.free_block_queue.get_all_free_blocks())


def keys(pool, block_ids: list[int]) -> list:
    return [pool.blocks[i].cache_key for i in block_ids]


def resume(manager: KVCacheManager, request: FakeRequest) -> KVCacheBlocks:
    blocks, num_tokens = manager.get_swapped_blocks(request)
    request.num_computed_tokens = 0
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_tokens, num_tokens, blocks
    )
    request.num_computed_tokens = request.num_tokens
    return new_blocks


def test_no_host_tier_by_default():
    manager = KVCacheManager(4, BS, 200)
    assert manager.host_block_pool is None and not manager.has_host_tier
    assert manager.host_usage == 0.0 and manager.take_block_copies() == ([], [])
    assert not manager.is_swapped("a")
    with pytest.raises(RuntimeError):
        manager.swap_out(FakeRequest("a", [1], BS))


def test_swap_out_then_resume():
    manager = make_manager(10, num_host_blocks=6)
    device, host = manager.block_pool, manager.host_block_pool
    assert host.is_host and all(b.is_host for b in host.blocks)
    a = FakeRequest("a", list(range(10)), BS)
    assert prefill(manager, a).get_block_ids() == [[1, 2, 3]]
    a.append_token(10)
    h = a.block_hashes
    assert manager.take_block_copies() == ([], [])

    assert manager.swap_out(a)
    assert manager.is_swapped("a")
    # One host block per device block; the full ones get the device block's key.
    assert keys(host, [1, 2, 3]) == [(h[0], 0), (h[1], 0), None]
    assert ref_cnts(host, [1, 2, 3]) == [2, 2, 2]  # the swapped request, and this step's copy
    assert host_free_ids(manager) == [4, 5]
    # The device blocks are freed like free(): tail first, keeping their keys.
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert keys(device, [1, 2, 3]) == [(h[0], 0), (h[1], 0), None]
    assert manager.get_block_ids("a") == [[]]
    with pytest.raises(ValueError):  # its copies have not run yet
        manager.get_swapped_blocks(a)
    assert manager.take_block_copies() == ([(1, 1), (2, 2), (3, 3)], [])
    assert ref_cnts(host, [1, 2, 3]) == [1, 1, 1]
    assert manager.host_usage == pytest.approx(0.6)

    blocks, num_tokens = manager.get_swapped_blocks(a)
    assert blocks.get_block_ids() == [[1, 2, 3]] and num_tokens == 10
    assert all(b.is_host for b in blocks.blocks[0])
    assert resume(manager, a).get_block_ids() == [[]]
    assert not manager.is_swapped("a")
    assert manager.get_block_ids("a") == [[4, 5, 6]]
    assert keys(device, [4, 5, 6]) == [(h[0], 0), (h[1], 0), None]
    assert ref_cnts(device, [4, 5, 6]) == [1, 1, 1]
    assert ref_cnts(host, [1, 2, 3]) == [2, 2, 2]  # held for the copies, until they are taken
    assert manager.take_block_copies() == ([], [(1, 4), (2, 5), (3, 6)])
    assert ref_cnts(host, [1, 2, 3]) == [0, 0, 0]
    assert host_free_ids(manager) == [4, 5, 3, 2, 1]
    assert keys(host, [1, 2]) == [(h[0], 0), (h[1], 0)]
    check_invariants(manager, {"a": a})

    # The partial last block is cached once it fills.
    a.append_token(11)
    assert manager.allocate_slots(a, 1).get_block_ids() == [[]]
    a.num_computed_tokens += 1
    assert device.blocks[6].cache_key == (a.block_hashes[2], 0)
    check_invariants(manager, {"a": a})
    counts = (
        manager.num_swapped_out_blocks,
        manager.num_swapped_in_blocks,
        manager.num_spilled_blocks,
    )
    assert counts == (3, 3, 0)
    manager.free(a)
    assert device.get_num_free_blocks() == 9 and host.get_num_free_blocks() == 5


def test_swap_out_refused_when_the_host_is_full():
    manager = make_manager(10, num_host_blocks=3)
    a = FakeRequest("a", list(range(10)), BS)
    prefill(manager, a)
    before = (snapshot(manager), host_free_ids(manager))
    assert not manager.swap_out(a)
    assert (snapshot(manager), host_free_ids(manager)) == before
    assert not manager.is_swapped("a")
    assert manager.take_block_copies() == ([], [])
    assert manager.num_swapped_out_blocks == 0


def test_spill_on_eviction_and_held_spills_are_no_hits():
    manager = make_manager(4, num_host_blocks=4)
    device, host = manager.block_pool, manager.host_block_pool
    a = FakeRequest("a", list(range(8)), BS)
    assert prefill(manager, a).get_block_ids() == [[1, 2]]
    manager.free(a)
    assert free_ids(manager) == [3, 2, 1]
    assert manager.take_block_copies() == ([], [])

    b = FakeRequest("b", list(range(50, 58)), BS)
    assert prefill(manager, b).get_block_ids() == [[3, 2]]
    h = a.block_hashes
    assert host.blocks[1].cache_key == (h[1], 0) and host.blocks[1].ref_cnt == 1
    assert manager.num_spilled_blocks == 1
    manager.make_prefix_cache_stats()
    # The spilled copy runs this step: it is no hit before the copies are taken.
    c = FakeRequest("c", list(range(8)) + [9], BS)
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert hits.get_block_ids() == [[1]] and num_hit_tokens == 4
    assert manager.take_block_copies() == ([(2, 1)], [])
    assert host_free_ids(manager) == [2, 3, 1]
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert hits.get_block_ids() == [[1, 1]] and num_hit_tokens == 8
    assert [b.is_host for b in hits.blocks[0]] == [False, True]
    assert device.blocks[1].ref_cnt == 0 and host.blocks[1].ref_cnt == 0
    stats = manager.make_prefix_cache_stats()
    assert stats == PrefixCacheStats(requests=2, queries=18, hits=12, host_hits=4)


def test_no_spill_while_another_device_block_caches_the_key():
    manager = make_manager(5, num_host_blocks=4)
    pool = manager.block_pool
    r = FakeRequest("r", list(range(4)), BS)
    blocks = pool.get_new_blocks(2)
    for block in blocks:
        pool.cache_full_blocks(r, [block], 0, 1, 0)
    pool.free_blocks(blocks)
    assert free_ids(manager) == [3, 4, 1, 2]
    x = FakeRequest("x", list(range(50, 63)), BS)
    assert prefill(manager, x).get_block_ids() == [[3, 4, 1, 2]]
    # Block 1 lost its key while block 2 still cached it; block 2 was the last copy.
    assert manager.take_block_copies() == ([(2, 1)], [])
    assert manager.host_block_pool.blocks[1].cache_key == (r.block_hashes[0], 0)


def test_no_spill_when_the_host_caches_the_key_and_abort_while_swapped():
    manager = make_manager(3, num_host_blocks=3)
    host = manager.host_block_pool
    a = FakeRequest("a", list(range(8)), BS)
    prefill(manager, a)
    a.append_token(8)
    assert manager.swap_out(a)
    assert manager.take_block_copies() == ([(1, 1), (2, 2)], [])
    assert free_ids(manager) == [2, 1] and host_free_ids(manager) == []

    b = FakeRequest("b", list(range(50, 58)), BS)
    assert prefill(manager, b).get_block_ids() == [[2, 1]]
    assert manager.take_block_copies() == ([], [])
    assert manager.num_spilled_blocks == 0

    manager.free(a)  # aborted while swapped: its host blocks are freed, tail first
    assert not manager.is_swapped("a")
    assert host_free_ids(manager) == [2, 1] and ref_cnts(host, [1, 2]) == [0, 0]
    manager.free(b)
    assert manager.block_pool.get_num_free_blocks() == 2


def test_host_hit_promotion_mixed_with_device_hits():
    manager = make_manager(5, num_host_blocks=5)
    device, host = manager.block_pool, manager.host_block_pool
    a = FakeRequest("a", list(range(12)), BS)
    assert prefill(manager, a).get_block_ids() == [[1, 2, 3]]
    manager.free(a)
    b = FakeRequest("b", list(range(50, 62)), BS)
    assert prefill(manager, b).get_block_ids() == [[4, 3, 2]]
    assert manager.take_block_copies() == ([(3, 1), (2, 2)], [])
    assert host_free_ids(manager) == [3, 4, 1, 2]
    manager.free(b)
    assert free_ids(manager) == [1, 2, 3, 4]

    h = a.block_hashes
    c = FakeRequest("c", list(range(12)) + [99], BS)
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert hits.get_block_ids() == [[1, 2, 1]] and num_hit_tokens == 12
    assert [b.is_host for b in hits.blocks[0]] == [False, True, True]
    # One new block for the last token, the free device hit, and one per host hit: 4.
    assert manager.allocate_slots(c, 1, 12, hits).get_block_ids() == [[4]]
    c.num_computed_tokens = 13
    # Host hits 2 and 1 went to device blocks 2 and 3, whose cached blocks spilled first.
    assert manager.get_block_ids("c") == [[1, 2, 3, 4]]
    assert keys(device, [1, 2, 3, 4]) == [(h[0], 0), (h[1], 0), (h[2], 0), None]
    assert ref_cnts(host, [1, 2, 3, 4]) == [1, 1, 1, 1]
    assert host_free_ids(manager) == []
    b_hashes = b.block_hashes
    assert keys(host, [3, 4]) == [(b_hashes[2], 0), (b_hashes[1], 0)]
    assert manager.take_block_copies() == ([(2, 3), (3, 4)], [(2, 2), (1, 3)])
    assert host_free_ids(manager) == [2, 1, 3, 4] and ref_cnts(host, [1, 2, 3, 4]) == [0] * 4
    counts = (manager.num_swapped_in_blocks, manager.num_spilled_blocks)
    assert counts == (2, 4)
    check_invariants(manager, {"c": c})


def test_sliding_window_host_hits_spill_what_they_evict():
    manager = make_manager(5, num_host_blocks=6, sliding_window=8)
    a = FakeRequest("a", list(range(16)), BS)
    prefill(manager, a)
    manager.free(a)
    b = FakeRequest("b", list(range(50, 66)), BS)
    assert prefill(manager, b).get_block_ids() == [[4, 3, 2, 1]]
    assert manager.take_block_copies() == ([(4, 1), (3, 2), (2, 3), (1, 4)], [])
    manager.free(b)

    c = FakeRequest("c", list(range(16)) + [99], BS)
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert hits.get_block_ids() == [[0, 0, 2, 1]] and num_hit_tokens == 16
    assert manager.make_prefix_cache_stats().host_hits == 8
    assert manager.allocate_slots(c, 1, 16, hits).get_block_ids() == [[3]]
    c.num_computed_tokens = 17
    assert manager.get_block_ids("c") == [[0, 0, 1, 2, 3]]
    assert manager.take_block_copies() == ([(1, 5), (2, 3), (3, 4)], [(2, 1), (1, 2)])
    assert free_ids(manager) == [4]
    check_invariants(manager, {"c": c})


def test_hybrid_swap_keeps_window_nulls_and_caches_the_last_block_when_full():
    manager = make_manager(13, num_host_blocks=13, group_windows=[None, 8])
    device, host = manager.block_pool, manager.host_block_pool
    a = FakeRequest("a", list(range(14)), BS)
    assert prefill(manager, a).get_block_ids() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    a.append_token(14)
    h = a.block_hashes
    assert manager.swap_out(a)
    # The window group's first block is before the next token's window: not copied.
    swapped = [(h[0], 0), (h[1], 0), (h[2], 0), None, (h[1], 1), (h[2], 1), None]
    assert keys(host, range(1, 8)) == swapped
    assert free_ids(manager) == [9, 10, 11, 12, 4, 8, 3, 7, 2, 6, 1, 5]
    copies = [(1, 1), (2, 2), (3, 3), (4, 4), (6, 5), (7, 6), (8, 7)]
    assert manager.take_block_copies() == (copies, [])
    blocks, num_tokens = manager.get_swapped_blocks(a)
    assert blocks.get_block_ids() == [[1, 2, 3, 4], [0, 5, 6, 7]] and num_tokens == 14

    resume(manager, a)
    assert manager.get_block_ids("a") == [[9, 10, 11, 12], [0, 4, 8, 3]]
    assert keys(device, [9, 10, 11, 12, 4, 8, 3]) == swapped
    assert free_ids(manager) == [7, 2, 6, 1, 5]
    swap_ins = [(1, 9), (2, 10), (3, 11), (4, 12), (5, 4), (6, 8), (7, 3)]
    assert manager.take_block_copies() == ([], swap_ins)
    assert host_free_ids(manager) == [8, 9, 10, 11, 12, 4, 7, 3, 6, 2, 5, 1]
    check_invariants(manager, {"a": a})

    a.append_token(15)
    assert manager.allocate_slots(a, 1).get_block_ids() == [[], []]
    a.num_computed_tokens += 1
    assert manager.get_block_ids("a") == [[9, 10, 11, 12], [0, 0, 8, 3]]
    assert keys(device, [12, 3]) == [(a.block_hashes[3], 0), (a.block_hashes[3], 1)]
    check_invariants(manager, {"a": a})


def test_shared_blocks_swapped_out_in_one_step_are_copied_once():
    manager = make_manager(
        10, num_host_blocks=7
    )  # the room check does not count on sharing: 3 + 3 free
    host = manager.host_block_pool
    a = FakeRequest("a", list(range(8)) + [1], BS)
    b = FakeRequest("b", list(range(8)) + [2], BS)
    assert prefill(manager, a).get_block_ids() == [[1, 2, 3]]
    assert prefill(manager, b).get_block_ids() == [[1, 2, 4]]
    a.append_token(3)
    b.append_token(3)
    manager.take_block_copies()
    assert manager.swap_out(a) and manager.swap_out(b)
    assert ref_cnts(host, [1, 2, 3, 4]) == [3, 3, 2, 2]
    assert manager.take_block_copies() == ([(1, 1), (2, 2), (3, 3), (4, 4)], [])
    assert free_ids(manager) == [5, 6, 7, 8, 9, 3, 4, 2, 1]

    resume(manager, a)
    assert manager.get_block_ids("a") == [[5, 6, 7]]
    # b's host blocks 1 and 2 are copied to the device this step already: b takes a device
    # block caching the same key instead of copying them twice.
    resume(manager, b)
    assert manager.get_block_ids("b") == [[1, 2, 8]]
    assert manager.take_block_copies() == ([], [(1, 5), (2, 6), (3, 7), (4, 8)])
    assert host_free_ids(manager) == [5, 6, 3, 4, 2, 1]
    assert all(block.ref_cnt == 0 for block in host.blocks)
    check_invariants(manager, {"a": a, "b": b})


def test_reset_prefix_cache_covers_both_tiers():
    manager = make_manager(4, num_host_blocks=4)
    device, host = manager.block_pool, manager.host_block_pool
    a = FakeRequest("a", list(range(8)) + [1], BS)
    prefill(manager, a)
    assert manager.swap_out(a)
    assert not manager.reset_prefix_cache()  # host blocks held for the copies and by a
    manager.take_block_copies()
    assert not manager.reset_prefix_cache()  # a is swapped
    manager.free(a)
    b = FakeRequest("b", list(range(50, 62)), BS)
    prefill(manager, b)  # evicts a's cached blocks: nothing spills, the host has them
    manager.free(b)
    assert manager.take_block_copies() == ([], [])
    assert host.cached_block_hash_to_block and device.cached_block_hash_to_block
    assert manager.reset_prefix_cache()
    assert not host.cached_block_hash_to_block and not device.cached_block_hash_to_block
    assert all(b.cache_key is None for b in host.blocks + device.blocks)


def test_a_swap_copies_and_spills_only_computed_blocks():
    """Swapped out in the step that scheduled 8 more of its tokens (two blocks cached for
    them): the host gets its computed block, the two uncomputed blocks lose their hashes,
    and evicting them later spills nothing."""
    manager = make_manager(6, num_host_blocks=4)
    a = FakeRequest("a", list(range(14)), BS)
    manager.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    assert manager.allocate_slots(a, 10).get_block_ids() == [[2, 3, 4]]
    assert manager.swap_out(a)
    assert manager.take_block_copies() == ([(1, 1)], [])
    device = manager.block_pool
    assert keys(device, [1, 2, 3, 4]) == [(a.block_hashes[0], 0), None, None, None]
    assert free_ids(manager) == [5, 4, 3, 2, 1]
    b = FakeRequest("b", list(range(50, 66)), BS)
    assert prefill(manager, b).get_block_ids() == [[5, 4, 3, 2]]
    assert manager.num_spilled_blocks == 0 and manager.take_block_copies() == ([], [])
