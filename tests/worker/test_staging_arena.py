"""The staging arena: aligned typed slots over one host and one device byte buffer, and one
copy of exactly the committed byte range."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.batch_split import max_staged_bytes, split_batch
from worker.block_table import MultiGroupBlockTable
from worker.buffers import InputBuffers
from worker.staging_arena import ALIGNMENT, SlotSpec, StagingArena, StagingScratch

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
]
# Odd sizes, so that an unaligned layout would show.
SPECS = [SlotSpec(f"s{i}", (3 + i, 5), dtype) for i, dtype in enumerate(DTYPES)]


def _offset(arena: StagingArena, tensor: torch.Tensor, device: bool = False) -> int:
    base = arena.device_bytes if device else arena.host
    return tensor.data_ptr() - base.data_ptr()


def test_slots_are_aligned_disjoint_and_typed():
    arena = StagingArena(SPECS, "cpu", separate=True)
    spans = []
    for spec in SPECS:
        slot = arena.slots[spec.name]
        assert slot.cpu.dtype == slot.gpu.dtype == spec.dtype
        assert slot.cpu.shape == slot.gpu.shape == spec.shape and slot.cpu.is_contiguous()
        assert slot.np.shape == spec.shape and slot.np.dtype == slot.cpu.numpy().dtype
        offset = _offset(arena, slot.cpu)
        assert offset % ALIGNMENT == 0 and offset == _offset(arena, slot.gpu, device=True)
        spans.append((offset, offset + spec.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= arena.host.numel() == arena.device_bytes.numel()


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_of_every_dtype_round_trip(dtype):
    arena = StagingArena([SlotSpec("pad", (1,), torch.uint8), SlotSpec("x", (7,), dtype)], "cpu")
    slot = arena.slots["x"]
    values = torch.arange(7).remainder(2 if dtype == torch.bool else 100).to(dtype)
    slot.np[:] = values.numpy()
    assert torch.equal(slot.cpu, values)
    assert slot.gpu is slot.cpu  # a shared arena: the host is the device


def test_a_copy_moves_exactly_the_committed_prefix():
    arena = StagingArena(SPECS, "cpu", separate=True)
    generator = torch.Generator().manual_seed(0)
    arena.host.copy_(torch.randint(1, 256, arena.host.shape, generator=generator))
    slot = arena.slots["s4"]  # int32 [7, 5]
    slot.commit(3)
    arena.slots["s1"].commit(2)  # ends before s4's rows: the range is the furthest end
    end = _offset(arena, slot.cpu) + 3 * 5 * 4
    assert arena.copy_to_device() == end
    assert torch.equal(arena.device_bytes[:end], arena.host[:end])
    assert not arena.device_bytes[end:].any()
    assert torch.equal(slot.gpu[:3], slot.cpu[:3]) and not slot.gpu[3:].any()
    assert arena.copy_to_device() == 0  # each copy starts a new range


def test_a_shared_arena_copies_nothing():
    arena = StagingArena(SPECS, "cpu")
    assert arena.device_bytes is arena.host
    arena.slots["s5"].commit(4)
    assert arena.copy_to_device() == 0


def test_block_table_rows_past_the_commit_stay_invisible():
    """Two KV cache groups in one arena slot: a group's table is a row-strided view, and a
    row staged but not committed reaches the device with no copy."""
    buffers = InputBuffers(4, 8, 6, torch.device("cpu"), 2, separate_device_arena=True)
    tables = MultiGroupBlockTable(4, 6, 16, "cpu", 2, buffers.batch_staging.block_tables)
    tables.add_row([[1, 2], [3]], 0)
    tables.add_row([[4], [5, 6, 7]], 1)
    tables.commit(1)
    buffers.copy_to_device()
    tables.add_row([[8], [9]], 2)
    buffers.copy_to_device()
    group0, group1 = (table.get_device_tensor() for table in tables.groups)
    assert group0.stride() == (2 * 6, 1)
    assert group0[:, :3].tolist() == [[1, 2, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert group1[:, :3].tolist() == [[3, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    tables.commit(3)
    buffers.copy_to_device()
    assert group0[:3, 0].tolist() == [1, 4, 8] and group1[:3, :3].tolist() == [
        [3, 0, 0],
        [5, 6, 7],
        [9, 0, 0],
    ]


def test_scratch_packs_aligned_arrays_and_starts_over_at_reset():
    arena = StagingArena([SlotSpec("scratch", (4 * ALIGNMENT,), torch.uint8)], "cpu", separate=True)
    scratch = StagingScratch(arena.slots["scratch"])
    a = scratch.stage(np.array([1, 2, 3]), torch.int64)
    b = scratch.stage(np.array([4, 5]), torch.int32)
    assert _offset(arena, a, device=True) == 0 and _offset(arena, b, device=True) == ALIGNMENT
    assert not a.any()  # on the device only after the copy
    assert arena.copy_to_device() == ALIGNMENT + 2 * 4
    assert a.tolist() == [1, 2, 3] and b.dtype == torch.int32 and b.tolist() == [4, 5]
    scratch.reset()
    c = scratch.stage(np.array([9]), torch.int64)
    assert c.data_ptr() == a.data_ptr()
    with pytest.raises(RuntimeError, match="too small"):
        scratch.stage(np.zeros(4 * ALIGNMENT // 8), torch.int64)


def test_scratch_without_a_slot_wraps_the_array():
    array = np.array([1, 2, 3])
    staged = StagingScratch(None).stage(array, torch.int64)
    assert staged.data_ptr() == array.ctypes.data


@st.composite
def batches(draw):
    """query_start_loc and seq_lens of a batch of decodes and prefills in any order."""
    query_lens = draw(st.lists(st.integers(1, 9), min_size=1, max_size=24))
    seq_lens = [q + draw(st.integers(0, 30)) for q in query_lens]
    return np.concatenate(([0], np.cumsum(query_lens))), np.array(seq_lens)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_the_split_stages_within_its_bound_and_equals_its_own_copies(batch):
    query_start_loc, seq_lens = batch
    max_num_reqs, max_num_tokens = len(seq_lens), int(query_start_loc[-1])
    size = max_staged_bytes(max_num_reqs, max_num_tokens, ALIGNMENT)
    arena = StagingArena([SlotSpec("scratch", (size,), torch.uint8)], "cpu", separate=True)
    qsl = torch.from_numpy(query_start_loc.astype(np.int32))
    lens = torch.from_numpy(seq_lens.astype(np.int32))
    staged = split_batch(
        qsl, lens, torch.device("cpu"), StagingScratch(arena.slots["scratch"]).stage
    )
    arena.copy_to_device()
    expected = split_batch(qsl, lens, torch.device("cpu"))
    for name, value in vars(expected).items():
        got = getattr(staged, name)
        if name == "decode_groups":
            assert [(g.reqs.tolist(), _rows(g.rows), g.max_seq_len) for g in got] == [
                (g.reqs.tolist(), _rows(g.rows), g.max_seq_len) for g in value
            ]
        elif isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.tolist() == value.tolist(), name
            assert got.untyped_storage().data_ptr() == arena.device_bytes.data_ptr()
        else:
            assert _rows(got) == _rows(value), name


def _rows(rows):
    return rows.tolist() if isinstance(rows, torch.Tensor) else rows
