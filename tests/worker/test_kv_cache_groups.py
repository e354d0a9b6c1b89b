"""Layers grouped by attention type into KV cache groups of one size."""

from worker.block_table import MultiGroupBlockTable
from worker.kv_cache_groups import KVCacheGroup, group_layers, group_size


def test_one_attention_type_is_one_group():
    assert group_layers([None] * 4) == [KVCacheGroup(None, (0, 1, 2, 3))]
    assert group_layers([8] * 3) == [KVCacheGroup(8, (0, 1, 2))]


def test_close_counts_keep_each_type_whole():
    """Qwen2 with max_window_layers=2 of 4; 8 full to 9 window layers (within 25 %); at
    4 to 5 (25 % more) the larger type splits."""
    assert group_layers([None, None, 8, 8]) == [
        KVCacheGroup(None, (0, 1)),
        KVCacheGroup(8, (2, 3)),
    ]
    groups = group_layers([None, 8] * 8 + [8])
    assert groups == [
        KVCacheGroup(None, tuple(range(0, 16, 2))),
        KVCacheGroup(8, (*range(1, 16, 2), 16)),
    ]
    assert group_size(groups) == 9
    assert group_layers([None, 8] * 4 + [8]) == [
        KVCacheGroup(None, (0, 2, 4, 6)),
        KVCacheGroup(8, (1, 3, 5, 7)),
        KVCacheGroup(8, (8,)),
    ]


def test_gemma3_pattern_splits_the_local_layers():
    """Five local layers to one global: groups the size of the global layers' count."""
    windows = [None if (i + 1) % 6 == 0 else 16 for i in range(12)]
    groups = group_layers(windows)
    assert groups[0] == KVCacheGroup(16, (0, 1))
    assert KVCacheGroup(None, (5, 11)) in groups
    assert all(len(g.layers) == 2 for g in groups) and len(groups) == 6
    assert sorted(layer for g in groups for layer in g.layers) == list(range(12))
    assert group_size(groups) == 2


def test_multi_group_block_table_keeps_rows_in_step():
    table = MultiGroupBlockTable(4, 6, block_size=4, device="cpu", num_groups=2)
    table.add_row([[1, 2], [0, 7]], row=0)
    table.add_row([[3], [8]], row=2)
    table.append_row([[4], []], row=0)
    table.move_row(2, 1)
    table.clear_row(2)
    rows = [[t.np[r, : t.num_blocks_per_row[r]].tolist() for t in table.groups] for r in (0, 1, 2)]
    assert rows == [[[1, 2, 4], [0, 7]], [[3], [8]], [[], []]]
