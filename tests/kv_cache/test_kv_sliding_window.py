from kv_fakes import (
    BS,
    FakeRequest,
    check_invariants,
    free_ids,
    make_manager,
    prefill,
    snapshot,
)

from kv_cache import SlidingWindowManager

WINDOW = 8  # the next token attends to itself and the 7 tokens before it: 2 blocks of 4


def test_blocks_outside_the_window_become_null_and_are_freed():
    manager = make_manager(12, sliding_window=WINDOW)
    a = FakeRequest("a", list(range(20)), BS)
    prefill(manager, a)
    assert manager.get_block_ids("a") == [[1, 2, 3, 4, 5]]
    a.append_token(20)
    # Position 20 attends to 13..20: blocks 0-2 (tokens 0-11) are wholly skipped.
    assert manager.allocate_slots(a, 1).get_block_ids() == [[6]]
    assert manager.get_block_ids("a") == [[0, 0, 0, 4, 5, 6]]
    assert free_ids(manager) == [7, 8, 9, 10, 11, 3, 2, 1]
    # Freed blocks keep their hashes until reused.
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2, 3)] == a.block_hashes[:3]
    a.num_computed_tokens = 21
    a.append_token(21)
    assert manager.allocate_slots(a, 1).get_block_ids() == [[]]
    assert manager.get_block_ids("a") == [[0, 0, 0, 4, 5, 6]]
    check_invariants(manager, {"a": a})
    manager.free(a)
    assert free_ids(manager) == [7, 8, 9, 10, 11, 3, 2, 1, 6, 5, 4]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_remove_skipped_blocks_stops_at_first_null():
    manager = make_manager(12, sliding_window=WINDOW)
    stm = manager.single_type_managers[0]
    assert isinstance(stm, SlidingWindowManager)
    a = FakeRequest("a", list(range(24)), BS)
    prefill(manager, a)
    stm.remove_skipped_blocks("a", 13)  # skips 6 tokens: block 0 only
    assert manager.get_block_ids("a") == [[0, 2, 3, 4, 5, 6]]
    stm.remove_skipped_blocks("a", 18)  # position 18 attends to 11..18: block 2 is still needed
    assert manager.get_block_ids("a") == [[0, 0, 3, 4, 5, 6]]
    stm.remove_skipped_blocks("a", 19)  # position 19 attends to 12..19
    assert manager.get_block_ids("a") == [[0, 0, 0, 4, 5, 6]]
    stm.remove_skipped_blocks("a", 23)  # skips 16 tokens: blocks 0-3
    assert manager.get_block_ids("a") == [[0, 0, 0, 0, 5, 6]]
    assert free_ids(manager) == [7, 8, 9, 10, 11, 1, 2, 3, 4]


def test_cache_hit_pads_nulls_before_the_last_window():
    manager = make_manager(12, sliding_window=WINDOW)
    a = FakeRequest("a", list(range(20)), BS)
    prefill(manager, a)
    a.append_token(20)
    manager.allocate_slots(a, 1)
    b = FakeRequest("b", list(range(20)) + [99], BS)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert hits.get_block_ids() == [[0, 0, 0, 4, 5]] and num_hit_tokens == 20
    before_free = free_ids(manager)
    assert manager.allocate_slots(b, 1, num_hit_tokens, hits).get_block_ids() == [[7]]
    a.num_computed_tokens = b.num_computed_tokens = 21
    assert manager.get_block_ids("b") == [[0, 0, 0, 4, 5, 7]]
    assert free_ids(manager) == before_free[1:]
    assert manager.block_pool.blocks[4].ref_cnt == 2
    assert manager.block_pool.null_block.ref_cnt == 0
    check_invariants(manager, {"a": a, "b": b})


def test_cache_hit_takes_rightmost_full_window_run():
    manager = make_manager(12, sliding_window=WINDOW)
    a = FakeRequest("a", list(range(24)), BS)
    prefill(manager, a)
    assert manager.get_block_ids("a") == [[1, 2, 3, 4, 5, 6]]
    stm = manager.single_type_managers[0]
    h = a.block_hashes
    hits = stm.find_longest_cache_hit(h[:3] + [b"miss"] + h[4:], 24)
    assert [b.block_id for b in hits] == [0, 0, 0, 0, 5, 6]
    hits = stm.find_longest_cache_hit(h[:5] + [b"miss"], 24)
    assert [b.block_id for b in hits] == [0, 0, 0, 4, 5]
    # max_length caps the scan: with 19 tokens only blocks 0..3 may hit.
    assert [b.block_id for b in stm.find_longest_cache_hit(h, 19)] == [0, 0, 3, 4]
    # Evicting the last two cached blocks moves the hit back to the previous run.
    manager.free(a)
    manager.allocate_slots(FakeRequest("x", [7] * 28, BS), 28)
    hits = stm.find_longest_cache_hit(h, 24)
    assert [b.block_id for b in hits] == [0, 0, 3, 4]


def test_cache_hit_without_a_full_window_falls_back_to_leading_prefix():
    manager = make_manager(12, sliding_window=WINDOW)
    a = FakeRequest("a", list(range(12)), BS)
    prefill(manager, a)
    stm = manager.single_type_managers[0]
    # Only block 0 matches: no run of 2, but a prefix from block 0 is still a valid hit.
    b = FakeRequest("b", list(range(4)) + [50] * 9, BS)
    assert [x.block_id for x in stm.find_longest_cache_hit(b.block_hashes, 12)] == [1]
    # A lone hit after a miss is no hit: the window before it is not cached.
    hashes = [b"missing"] + a.block_hashes[1:2] + [b"missing2"]
    assert stm.find_longest_cache_hit(hashes, 12) == []
    # A run of 2 anywhere is enough; trailing blocks after the run are not taken.
    hashes = [b"missing"] + a.block_hashes[1:3] + [b"missing2"]
    assert [x.block_id for x in stm.find_longest_cache_hit(hashes, 16)] == [0, 2, 3]


def test_refused_allocation_changes_nothing():
    manager = make_manager(6, sliding_window=WINDOW)
    a = FakeRequest("a", list(range(20)), BS)
    prefill(manager, a)
    before = snapshot(manager)
    assert manager.allocate_slots(FakeRequest("b", [1] * 4, BS), 4) is None
    assert snapshot(manager) == before
