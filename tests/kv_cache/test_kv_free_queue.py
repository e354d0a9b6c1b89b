import pytest

from kv_cache import FreeKVCacheBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_starts_in_block_id_order():
    queue, _ = make_queue(5)
    assert queue.num_free_blocks == 5
    assert queue_ids(queue) == [0, 1, 2, 3, 4]


def test_popleft_until_empty_then_value_error():
    queue, blocks = make_queue(2)
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert queue.num_free_blocks == 0 and queue_ids(queue) == []
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    with pytest.raises(ValueError):
        queue.popleft()


def test_popleft_n_and_append_n_keep_order():
    queue, blocks = make_queue(6)
    popped = queue.popleft_n(3)
    assert [b.block_id for b in popped] == [0, 1, 2]
    assert queue_ids(queue) == [3, 4, 5]
    queue.append_n([blocks[2], blocks[0], blocks[1]])
    assert queue_ids(queue) == [3, 4, 5, 2, 0, 1]
    assert queue.num_free_blocks == 6
    assert queue.popleft_n(0) == []
    with pytest.raises(ValueError):
        queue.popleft_n(7)
    assert queue.num_free_blocks == 6


@pytest.mark.parametrize(("victim", "rest"), [(0, [1, 2, 3]), (2, [0, 1, 3]), (3, [0, 1, 2])])
def test_remove_head_middle_tail(victim, rest):
    queue, blocks = make_queue(4)
    queue.remove(blocks[victim])
    assert queue_ids(queue) == rest
    assert queue.num_free_blocks == 3
    assert blocks[victim].prev_free_block is None and blocks[victim].next_free_block is None
    queue.append(blocks[victim])
    assert queue_ids(queue) == rest + [victim]


def test_remove_block_not_in_queue_raises():
    queue, _ = make_queue(3)
    block = queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(block)
    with pytest.raises(RuntimeError):
        queue.remove(KVCacheBlock(99))
    assert queue.num_free_blocks == 2 and queue_ids(queue) == [1, 2]


def test_append_block_already_in_queue_raises():
    queue, blocks = make_queue(3)
    with pytest.raises(RuntimeError):
        queue.append(blocks[1])
    assert queue_ids(queue) == [0, 1, 2]


def test_cache_key_is_set_once():
    block = KVCacheBlock(7)
    assert block.cache_key is None and block.block_hash is None
    assert block.ref_cnt == 0 and not block.is_null
    block.cache_key = (b"h", 1)
    assert block.block_hash == b"h"
    with pytest.raises(AssertionError):
        block.cache_key = (b"g", 0)
    block.reset_hash()
    assert block.cache_key is None and block.block_hash is None
    block.cache_key = (b"g", 0)
    assert block.cache_key == (b"g", 0) and block.block_hash == b"g"
