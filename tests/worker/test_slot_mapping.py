"""The slot-mapping Triton kernel (on the GPU, or under TRITON_INTERPRET=1 without one) and
the torch path against a per-token reference."""

import numpy as np
import pytest
import torch

from worker.block_table import BlockTable
from worker.slot_mapping import slot_mapping_torch, slot_mapping_triton


def reference_slot_mapping(block_table, query_start_loc, positions, block_size, num_out):
    out = np.full(num_out, -1, dtype=np.int64)
    for req in range(len(query_start_loc) - 1):
        for token in range(query_start_loc[req], query_start_loc[req + 1]):
            pos = int(positions[token])
            out[token] = int(block_table[req, pos // block_size]) * block_size + pos % block_size
    return out


def make_case(rng, num_reqs, block_size, max_blocks, low_id, high_id):
    """A committed-looking block table and a ragged batch: row i schedules n_i tokens at
    consecutive positions after its computed tokens (some rows schedule none)."""
    block_table = rng.integers(low_id, high_id, size=(num_reqs + 3, max_blocks), dtype=np.int32)
    capacity = max_blocks * block_size
    num_scheduled = rng.integers(0, 40, size=num_reqs)
    num_scheduled[rng.random(num_reqs) < 0.2] = 0
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum(num_scheduled)
    computed = rng.integers(0, capacity - num_scheduled + 1)
    positions = np.concatenate(
        [c + np.arange(n) for c, n in zip(computed, num_scheduled, strict=True)]
    ).astype(np.int64)
    return block_table, query_start_loc, positions


@pytest.mark.parametrize(
    "num_reqs, block_size, low_id, high_id, pad, tile",
    [
        (1, 16, 0, 1000, 0, 16),
        (7, 16, 0, 1000, 5, 16),
        (33, 4, 0, 50, 37, 32),
        (12, 16, 2**27, 2**31 - 1, 19, 1024),  # block_id * block_size overflows int32
        (5, 128, 2**20, 2**24, 0, 8),
    ],
)
def test_triton_and_torch_match_reference(
    kernel_device, num_reqs, block_size, low_id, high_id, pad, tile
):
    rng = np.random.default_rng(num_reqs * 1000 + block_size)
    block_table, query_start_loc, positions = make_case(
        rng, num_reqs, block_size, max(4, 96 // block_size), low_id, high_id
    )
    num_out = len(positions) + pad
    expected = reference_slot_mapping(block_table, query_start_loc, positions, block_size, num_out)
    args = (
        torch.from_numpy(block_table),
        torch.from_numpy(query_start_loc),
        torch.from_numpy(positions),
        block_size,
        num_out,
    )
    on_device = [a.to(kernel_device) if isinstance(a, torch.Tensor) else a for a in args]
    triton_out = slot_mapping_triton(*on_device, tile=tile).cpu()
    torch_out = slot_mapping_torch(*args)
    assert triton_out.dtype == torch_out.dtype == torch.int64
    np.testing.assert_array_equal(triton_out.numpy(), expected)
    np.testing.assert_array_equal(torch_out.numpy(), expected)
    if high_id > 2**28:
        assert expected.max() > 2**31


@pytest.mark.parametrize("fn", [slot_mapping_triton, slot_mapping_torch])
def test_padded_positions_and_empty_batch(fn, kernel_device):
    """Positions may already be padded (values there are garbage); only the padded length
    decides the output size. A batch with no tokens is all padding."""
    device = kernel_device if fn is slot_mapping_triton else "cpu"
    block_table = torch.tensor([[3, 9], [4, 0]], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    positions = torch.tensor([15, 16, 2, 999, 999], dtype=torch.int64, device=device)
    expected = [3 * 16 + 15, 9 * 16, 4 * 16 + 2, -1, -1, -1]
    assert fn(block_table, query_start_loc, positions, 16, 6).tolist() == expected
    assert fn(block_table, query_start_loc, positions, 16).tolist() == expected[:5]
    no_tokens = torch.zeros(1, dtype=torch.int32, device=device)
    assert fn(block_table, no_tokens, positions[:0], 16, 4).tolist() == [-1] * 4


@pytest.mark.parametrize("fn", [slot_mapping_triton, slot_mapping_torch])
def test_writes_into_a_persistent_buffer(fn, kernel_device):
    """With `out`, the slots land in the given rows of a buffer (its length is the padded
    length); rows past it are left alone."""
    device = kernel_device if fn is slot_mapping_triton else "cpu"
    block_table = torch.tensor([[3, 9], [4, 0]], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    positions = torch.tensor([15, 16, 2, 0], dtype=torch.int64, device=device)
    buffer = torch.full((8,), 7, dtype=torch.int64, device=device)
    out = fn(block_table, query_start_loc, positions, 16, out=buffer[:4])
    assert out.data_ptr() == buffer.data_ptr()
    assert buffer.tolist() == [3 * 16 + 15, 9 * 16, 4 * 16 + 2, -1, 7, 7, 7, 7]
    with pytest.raises(ValueError, match="not 5"):
        fn(block_table, query_start_loc, positions, 16, 5, out=buffer[:4])


def test_block_table_uses_committed_rows():
    table = BlockTable(max_num_reqs=4, max_num_blocks_per_req=3, block_size=8, device="cpu")
    table.add_row([5, 6], 0)
    table.add_row([7], 1)
    table.commit(2)
    table.add_row([100, 101], 0)  # staged, not committed
    query_start_loc = torch.tensor([0, 3, 4], dtype=torch.int32)
    positions = torch.tensor([6, 7, 8, 1])
    slots = table.compute_slot_mapping(query_start_loc, positions, num_tokens_padded=6)
    assert slots.tolist() == [46, 47, 48, 57, -1, -1]
    table.commit(2)
    slots = table.compute_slot_mapping(query_start_loc, positions)
    assert slots.tolist() == [806, 807, 808, 57]
