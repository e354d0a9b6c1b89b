import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.block_table import BlockTable

MAX_REQS, MAX_BLOCKS = 4, 6

block_ids = st.lists(st.integers(0, 2**31 - 1), max_size=3)
row = st.integers(0, MAX_REQS - 1)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), block_ids, row),
        st.tuples(st.just("append"), block_ids, row),
        st.tuples(st.just("clear"), row),
        st.tuples(st.just("move"), row, row),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_row_ops_match_list_model(ops):
    table = BlockTable(MAX_REQS, MAX_BLOCKS, block_size=16, device="cpu")
    model = [[] for _ in range(MAX_REQS)]
    for op, *args in ops:
        if op == "add":
            ids, r = args
            if len(ids) > MAX_BLOCKS:
                continue
            table.add_row(ids, r)
            model[r] = list(ids)
        elif op == "append":
            ids, r = args
            if len(model[r]) + len(ids) > MAX_BLOCKS:
                with pytest.raises(ValueError):
                    table.append_row(ids, r)
                continue
            table.append_row(ids, r)
            model[r] = model[r] + list(ids)
        elif op == "clear":
            table.clear_row(args[0])
            model[args[0]] = []
        else:
            src, tgt = args
            table.move_row(src, tgt)
            model[tgt] = list(model[src])
        for r, expected in enumerate(model):
            assert table.num_blocks_per_row[r] == len(expected)
            assert table.np[r, : len(expected)].tolist() == expected


def test_commit_copies_live_rows_only():
    table = BlockTable(MAX_REQS, MAX_BLOCKS, block_size=16, device="cpu")
    for r in range(MAX_REQS):
        table.add_row([10 * r + 1, 10 * r + 2], r)
    assert not table.get_device_tensor().any()
    table.commit(2)
    device_table = table.get_device_tensor()
    assert device_table.dtype == torch.int32
    assert device_table.shape == (MAX_REQS, MAX_BLOCKS)
    np.testing.assert_array_equal(device_table[:2].numpy(), table.np[:2])
    assert not device_table[2:].any()
    assert device_table.data_ptr() != torch.from_numpy(table.np).data_ptr()
