import pytest
from kv_fakes import FakeRequest, ids

from kv_cache import BlockPool


def pool_free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and pool_free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(1)


def test_get_new_blocks_pops_head_and_sets_ref_cnt():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3] and [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool_free_ids(pool) == [4, 5] and pool.get_usage() == 0.6
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool_free_ids(pool) == [4, 5]


def test_free_blocks_appends_in_given_order_and_keeps_hashes():
    pool = BlockPool(6)
    request = FakeRequest("a", list(range(8)), 4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 2, 0)
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks(reversed(blocks))
    assert [b.ref_cnt for b in blocks] == [1, 0, 0]
    assert pool_free_ids(pool) == [4, 5, 3, 2]
    assert blocks[1].block_hash == request.block_hashes[1]
    assert pool.get_cached_block(request.block_hashes[1], 0) is blocks[1]


def test_touch_takes_free_hits_out_of_the_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert pool_free_ids(pool) == [3, 4, 1, 2]
    pool.touch([blocks[1], pool.null_block])
    assert pool_free_ids(pool) == [3, 4, 1] and blocks[1].ref_cnt == 1
    assert pool.null_block.ref_cnt == 0


def test_lazy_eviction_on_reuse_drops_the_hash():
    pool = BlockPool(3)
    request = FakeRequest("a", [5, 6, 7, 8], 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 0)
    assert set(pool.cached_block_hash_to_block) == {(h, 0) for h in request.block_hashes}
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(request.block_hashes[1], 0) is blocks[1]
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[1] and reused.block_hash is None
    assert pool.get_cached_block(request.block_hashes[1], 0) is None
    assert pool.get_cached_block(request.block_hashes[0], 0) is blocks[0]
    assert set(pool.cached_block_hash_to_block) == {(request.block_hashes[0], 0)}


def test_caching_in_two_calls_caches_every_block():
    pool = BlockPool(4)
    request = FakeRequest("a", list(range(6)), 2)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 1, 0)
    pool.cache_full_blocks(request, blocks, 1, 3, 0)
    h = request.block_hashes
    assert [b.cache_key for b in blocks] == [(h[0], 0), (h[1], 0), (h[2], 0)]


def test_one_hash_may_map_to_several_blocks():
    pool = BlockPool(4)
    a, b = FakeRequest("a", [1, 2], 2), FakeRequest("b", [1, 2], 2)
    (block_a,) = pool.get_new_blocks(1)
    (block_b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [block_a], 0, 1, 0)
    pool.cache_full_blocks(b, [block_b], 0, 1, 0)
    h = a.block_hashes[0]
    assert set(pool.cached_block_hash_to_block[(h, 0)]) == {1, 2}
    assert pool.get_cached_block(h, 0) is block_a
    pool.free_blocks([block_a, block_b])
    pool.get_new_blocks(2)  # pops 3 then block_a
    assert pool.get_cached_block(h, 0) is block_b


def test_groups_cache_the_same_hash_apart():
    pool = BlockPool(5)
    request = FakeRequest("a", [1, 2, 3, 4], 2)
    h0, h1 = request.block_hashes
    full, window = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.cache_full_blocks(request, full, 0, 2, 0)
    pool.cache_full_blocks(request, window, 0, 2, 1)
    assert [b.cache_key for b in full + window] == [(h0, 0), (h1, 0), (h0, 1), (h1, 1)]
    assert pool.get_cached_block(h1, 0) is full[1] and pool.get_cached_block(h1, 1) is window[1]
    assert pool.get_cached_block(h1, 2) is None
    pool.free_blocks([window[1], full[1]])
    (reused,) = pool.get_new_blocks(1)  # the window group's copy of h1 is evicted first
    assert reused is window[1] and reused.cache_key is None
    assert pool.get_cached_block(h1, 1) is None and pool.get_cached_block(h1, 0) is full[1]


def test_reset_prefix_cache():
    pool = BlockPool(4)
    request = FakeRequest("a", [1, 2, 3, 4], 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 0)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0], 0) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.cached_block_hash_to_block == {}
