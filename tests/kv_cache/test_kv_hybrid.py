"""Hybrid models: several KV cache groups (full attention and sliding windows) over one pool."""

from kv_fakes import (
    BS,
    FakeRequest,
    check_invariants,
    decode,
    free_ids,
    make_manager,
    prefill,
    ref_cnts,
    snapshot,
)

from kv_cache import KVCacheBlocks, PrefixCacheStats


def test_full_and_window_groups_allocate_hit_and_free_their_own_blocks():
    manager = make_manager(16, group_windows=[None, 8])
    a = FakeRequest("a", list(range(10)), BS)
    assert manager.get_computed_blocks(a) == (KVCacheBlocks.empty(2), 0)
    assert manager.allocate_slots(a, 10).get_block_ids() == [[1, 2, 3], [4, 5, 6]]
    a.num_computed_tokens = 10
    pool = manager.block_pool
    h = a.block_hashes
    assert [pool.blocks[i].cache_key for i in (1, 2, 3)] == [(h[0], 0), (h[1], 0), None]
    assert [pool.blocks[i].cache_key for i in (4, 5, 6)] == [(h[0], 1), (h[1], 1), None]

    b = FakeRequest("b", list(range(8)) + [50, 51, 52], BS)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits.get_block_ids() == [[1, 2], [4, 5]] and num_hit_tokens == 8
    assert manager.allocate_slots(b, 3, 8, hits).get_block_ids() == [[7], [8]]
    b.num_computed_tokens = 11
    assert manager.get_block_ids("b") == [[1, 2, 7], [4, 5, 8]]
    assert ref_cnts(manager.block_pool, [1, 2, 3, 4, 5, 6, 7, 8]) == [2, 2, 1, 2, 2, 1, 1, 1]
    assert free_ids(manager) == list(range(9, 16))
    assert manager.make_prefix_cache_stats() == PrefixCacheStats(requests=2, queries=21, hits=8)
    check_invariants(manager, {"a": a, "b": b})

    # Position by position from the tail, every group's block of a position together.
    manager.free(a)
    assert free_ids(manager) == [*range(9, 16), 3, 6]
    manager.free(b)
    assert free_ids(manager) == [*range(9, 16), 3, 6, 7, 8, 2, 5, 1, 4]
    assert manager.block_pool.get_num_free_blocks() == 15
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def test_hit_is_cut_back_to_what_the_sliding_group_serves():
    manager = make_manager(13, group_windows=[None, 8])
    a = FakeRequest("a", list(range(20)), BS)
    assert prefill(manager, a).get_block_ids() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    # Position 20 attends to 13..20: the window group frees positions 2, 1, 0 (in that order).
    assert decode(manager, a, 20).get_block_ids() == [[11], [12]]
    assert manager.get_block_ids("a") == [[1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12]]
    assert free_ids(manager) == [8, 7, 6]
    c = FakeRequest("c", [99], BS)
    assert prefill(manager, c).get_block_ids() == [[8], [7]]  # evicts (h2, 1) and (h1, 1)

    b = FakeRequest("b", list(range(16)) + [99], BS)
    # Full attention alone would hit 16 tokens; the window group holds only h0 and h3 now, so
    # it serves a hit at 4 tokens (nothing precedes block 0), not at 16 (h2 missing).
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits.get_block_ids() == [[1], [6]] and num_hit_tokens == 4
    # 4 new blocks per group plus the free hit 6: 9 blocks, 1 free. Nothing changes.
    before = snapshot(manager)
    assert manager.allocate_slots(b, 13, 4, hits) is None
    assert snapshot(manager) == before

    manager.free(c)
    manager.free(a)
    assert free_ids(manager) == [6, 8, 7, 11, 12, 5, 10, 4, 9, 3, 2, 1]
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits.get_block_ids() == [[1], [6]] and num_hit_tokens == 4
    new_blocks = manager.allocate_slots(b, 13, 4, hits)
    assert new_blocks.get_block_ids() == [[8, 7, 11, 12], [5, 10, 4, 9]]
    b.num_computed_tokens = 17
    assert manager.get_block_ids("b") == [[1, 8, 7, 11, 12], [6, 5, 10, 4, 9]]
    assert free_ids(manager) == [3, 2]
    check_invariants(manager, {"b": b})


def test_every_group_takes_its_hits_before_any_group_allocates():
    manager = make_manager(17, group_windows=[None, 8])
    a = FakeRequest("a", list(range(20)), BS)
    prefill(manager, a)
    c = FakeRequest("c", list(range(50, 55)), BS)
    assert prefill(manager, c).get_block_ids() == [[11, 12], [13, 14]]
    assert decode(manager, a, 20).get_block_ids() == [[15], [16]]
    manager.free(c)
    # The window group's freed blocks of a sit at the head of the queue.
    assert free_ids(manager) == [8, 7, 6, 12, 14, 11, 13]

    b = FakeRequest("b", list(range(8)) + [99] * 5, BS)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits.get_block_ids() == [[1, 2], [6, 7]] and num_hit_tokens == 8
    # The full group's two new blocks must not be popped from under the window group's hits.
    assert manager.allocate_slots(b, 5, 8, hits).get_block_ids() == [[8, 12], [14, 11]]
    b.num_computed_tokens = 13
    assert manager.get_block_ids("b") == [[1, 2, 8, 12], [6, 7, 14, 11]]
    assert ref_cnts(manager.block_pool, [1, 2, 6, 7]) == [2, 2, 1, 1]
    assert free_ids(manager) == [13]
    check_invariants(manager, {"a": a, "b": b})


def test_sliding_groups_converge_on_a_length_both_serve():
    manager = make_manager(12, group_windows=[8, 5])  # windows of 2 blocks and of 1 block
    pool = manager.block_pool
    request = FakeRequest("r", list(range(25)), BS)
    null = pool.null_block
    # Group 0 caches h0..h4, group 1 caches h0, h1, h2 and h5 (nulls are skipped).
    group0 = pool.get_new_blocks(5)
    group1 = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, group0 + [null], 0, 6, 0)
    pool.cache_full_blocks(request, group1[:3] + [null, null, group1[3]], 0, 6, 1)
    pool.free_blocks(group0 + group1)
    # Group 0 alone serves 20 tokens (window h3, h4); group 1 at 20 serves 12 (window h2);
    # at 12, group 0's window is h1, h2: the hit must be taken again there, not truncated.
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert hits.get_block_ids() == [[0, 2, 3], [0, 0, 8]] and num_hit_tokens == 12
    assert free_ids(manager) == [10, 11, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert manager.allocate_slots(request, 13, 12, hits).get_block_ids() == [
        [10, 11, 1, 4],
        [5, 6, 7, 9],
    ]
    request.num_computed_tokens = 25
    check_invariants(manager, {"r": request})


def test_window_only_model_stops_growing_past_the_window():
    window = 10
    max_live = -(-(window - 1) // BS) + 1  # cdiv(W - 1, block_size) + 1 = 4
    manager = make_manager(
        6, group_windows=[window]
    )  # 5 usable blocks: a long request fits only by reuse
    a = FakeRequest("a", [7] * 6, BS)
    assert prefill(manager, a).get_block_ids() == [[1, 2]]
    live_counts = []
    for step in range(100):
        position = a.num_tokens
        assert decode(manager, a, step % 3) is not None
        (block_ids,) = manager.get_block_ids("a")
        assert len(block_ids) == position // BS + 1
        live = [i for i in block_ids if i != 0]
        first_needed = max(0, position - window + 1) // BS
        assert live == block_ids[first_needed:]
        assert manager.block_pool.get_num_free_blocks() == 5 - len(live)
        live_counts.append(len(live))
    # The window spans 4 blocks exactly when the new token starts a block: positions 12..104.
    assert max(live_counts) == max_live and live_counts.count(max_live) == 24
    check_invariants(manager, {"a": a})
    manager.free(a)
    assert manager.block_pool.get_num_free_blocks() == 5
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
