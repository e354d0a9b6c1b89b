"""Short rows on the CPU backend: rows of 2..SHORT_QUERY_LEN query tokens (a speculative
step's verification, short chunks) are attended by the C++ decode kernel, one entry per
query token, beside plain decodes and long prefills. Through the Attention layer against
the torch backend (which keeps them prefills) and float64 causal attention, built for
generic, AVX2 and this CPU's own ISA; with windows, fp8 pages, and the entries themselves."""

import pytest
import torch
from paged_requests import PagedRequests

from attention.backends.cpu_backend import (
    SHORT_QUERY_LEN,
    CPUAttentionBackend,
    CPUAttentionMetadata,
    load_cpu_attention,
)
from attention.backends.torch_backend import TorchAttentionBackend
from attention.store_kv import store_kv_torch
from kernels import KernelSet
from tests.quantization.isas import kernel_isas

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# fp8 pages against the values they were stored from (test_fp8_kv_cpu.py's LOOSE).
FP8_ROUNDING = {
    torch.float8_e4m3fn: dict(atol=0.1, rtol=0.1),
    torch.float8_e5m2: dict(atol=0.3, rtol=0.2),
}
# (num_heads, num_kv_heads, head_dim, block_size): tiny pages, and SmolLM2-135M's layout
# (the kernel's head_dim 64 specialisation).
LAYOUTS = {"tiny": (4, 2, 8, 4), "smollm2": (9, 3, 64, 16)}
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(scope="module", params=kernel_isas())
def kernels(request):
    module = load_cpu_attention(KernelSet(cpu=True, isa=request.param))
    assert module is not None, "the C++ kernels must build wherever the tests run (g++)"
    return module


def mixed_schedule(block_size: int) -> list[tuple[int, int, int]]:
    """(request, cached context, query length), interleaved: decodes, a short row of every
    length 2..SHORT_QUERY_LEN (fresh, ending or starting on a page boundary, crossing one
    or two), long prefills (fresh, after a cached prefix), and a padding request."""
    b = block_size
    decodes = [(0, 2 * b + 3, 1), (1, 0, 1), (2, b, 1)]
    shorts = [
        (3, b - 1, 2),  # crosses into the second page
        (4, 0, 3),  # a fresh 3-token prompt
        (5, 2 * b - 4, 4),  # ends on a page boundary
        (6, b, 5),  # starts on one
        (7, 3 * b - 2, 6),
        (8, 1, 7),
        (9, 5 * b - 1, SHORT_QUERY_LEN),  # crosses one (two with 4-token pages)
    ]
    longs = [(10, 0, SHORT_QUERY_LEN + 1), (11, b - 3, 2 * b + 5)]
    order = [shorts[0], decodes[0], longs[0], shorts[1], shorts[2], decodes[1], shorts[3]]
    order += [longs[1], shorts[4], decodes[2], shorts[5], shorts[6]]
    return order + [(12, 0, 0)]


def make_requests(
    schedule, layout: str, dtype=torch.float32, window=None, cache_prefixes=True
) -> PagedRequests:
    """The schedule's requests, their cached contexts in the pages unless told not to."""
    heads, kv_heads, head_dim, block_size = LAYOUTS[layout]
    lengths = {req: max(1, start + n) for req, start, n in schedule}
    seq_lens = [lengths[req] for req in range(len(lengths))]
    reqs = PagedRequests(
        seq_lens, heads, kv_heads, head_dim, block_size, sliding_window=window, dtype=dtype
    )
    for req, start, _ in schedule if cache_prefixes else []:
        reqs.cache_prefix(req, start)
    return reqs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 16])
def test_short_rows_match_the_torch_backend(kernels, layout, dtype, window):
    schedule = mixed_schedule(LAYOUTS[layout][3])
    reqs = make_requests(schedule, layout, dtype, window)
    outs = reqs.run_step(CPUAttentionBackend(kernels), schedule, num_padding=3)
    torch_outs = reqs.run_step(TorchAttentionBackend(), schedule, num_padding=3)
    for (req, start, n), out, expected in zip(schedule, outs, torch_outs, strict=True):
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
        if n:
            reference = reqs.expected(req, start, n).to(dtype)
            torch.testing.assert_close(out, reference, **TOLERANCE[dtype])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("window", [None, 5])
def test_short_rows_read_fp8_pages(kernels, fp8, window):
    """fp8 pages, stored with scales 0.5 (K) and 2 (V) as the layer stores them, read by
    both backends: the same pages, so they agree as closely as on 16-bit pages. Except a
    fresh prompt, which the torch backend attends over the step's own k/v: the decode
    kernel reads its fp8 pages, within fp8 rounding of that."""
    schedule = mixed_schedule(16)
    reqs = make_requests(schedule, "smollm2", window=window, cache_prefixes=False)
    reqs.kv_cache = (reqs.kv_cache * 0.1).to(fp8)  # finite fp8 garbage outside the contexts
    reqs.layer.kv_cache = reqs.kv_cache
    reqs.layer.load_kv_scale("k", torch.tensor(0.5))
    reqs.layer.load_kv_scale("v", torch.tensor(2.0))
    for req, start, _ in schedule:
        pos = torch.arange(start)
        slots = reqs.block_table[req, pos // 16].long() * 16 + pos % 16
        store_kv_torch(reqs.k[req][:start], reqs.v[req][:start], reqs.kv_cache, slots, 0.5, 2.0)
    outs = reqs.run_step(CPUAttentionBackend(kernels), schedule)
    torch_outs = reqs.run_step(TorchAttentionBackend(), schedule)
    for (_, start, n), out, expected in zip(schedule, outs, torch_outs, strict=True):
        fresh = start == 0 and n > 1
        torch.testing.assert_close(
            out, expected, **(FP8_ROUNDING[fp8] if fresh else TOLERANCE[torch.float32])
        )


def test_chunks_and_verification_rows_across_steps(kernels):
    """Each step stores its rows through the layer and later steps read them back:
    a prompt in short chunks, then rows of 1 + k tokens as a speculative step verifies."""
    reqs = PagedRequests([60, 45], *LAYOUTS["smollm2"])
    backend = CPUAttentionBackend(kernels)
    steps = [
        [(0, 0, 8), (1, 0, 20)],
        [(0, 8, 7), (1, 20, 4)],
        [(0, 15, 1), (1, 24, 8)],
        [(1, 32, 3), (0, 16, 6)],
        [(0, 22, 5), (1, 35, 2)],
    ]
    for schedule in steps:
        outs = reqs.run_step(backend, schedule)
        for (req, start, n), out in zip(schedule, outs, strict=True):
            expected = reqs.expected(req, start, n).float()
            torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


class RecordingKernels:
    """The kernel module, with each call's name and arguments recorded."""

    def __init__(self, module) -> None:
        self._module = module
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        function = getattr(self._module, name)

        def record(*args):
            self.calls.append((name, args))
            return function(*args)

        return record


def test_short_rows_are_decode_entries(kernels, monkeypatch):
    """One paged_decode call takes every query token of the decodes and short rows, each its
    own seq_len and block-table row; only the long rows reach the prefill paths."""
    schedule = [(0, 10, 1), (1, 5, 3), (2, 0, 12), (3, 7, 2), (4, 2, 8), (5, 1, 9), (6, 0, 0)]
    reqs = make_requests(schedule, "tiny")
    recording = RecordingKernels(kernels)
    backend = CPUAttentionBackend(recording)
    prefilled = []
    monkeypatch.setattr(backend, "_prefill", lambda spec, req, *args: prefilled.append(req))
    common, _ = reqs.metadata(schedule)
    md = backend.build_metadata(common)
    assert isinstance(md, CPUAttentionMetadata)
    entries = md.decodes
    assert entries.seq_lens.tolist() == [11, 6, 7, 8, 8, 9, *range(3, 11)]
    assert entries.rows.tolist() == [0, 1, 2, 3, 16, 17, *range(18, 26)]
    assert entries.reqs.tolist() == list(range(14))
    expected_table = common.block_table[[0, 1, 1, 1, 3, 3] + [4] * 8]
    assert torch.equal(entries.block_table, expected_table)
    assert md.long_prefill_reqs.tolist() == md.long_prefill_reqs_cpu == [2, 5]
    assert md.split.prefill_reqs_cpu == [1, 2, 3, 4, 5], "the split keeps its meaning"
    q = torch.randn(35, 4, 8)
    k, v = torch.randn(35, 2, 8), torch.randn(35, 2, 8)
    backend.attend(reqs.layer.spec, q, k, v, reqs.kv_cache, md, torch.empty_like(q))
    calls = dict(recording.calls)
    assert [name for name, _ in recording.calls] == ["paged_decode", "paged_prefill"]
    decode_args = calls["paged_decode"]
    assert decode_args[3] is entries.block_table and decode_args[4] is entries.seq_lens
    assert decode_args[5] is entries.reqs and decode_args[6] is entries.rows
    assert calls["paged_prefill"][6].tolist() == [2, 5]
    assert prefilled == [2, 5], "head_dim 8: the prefill kernels decline, torch takes it"


@pytest.mark.parametrize("schedule", [[(0, 10, 1), (1, 3, 1)], [(0, 10, 1), (1, 0, 12), (2, 3, 1)]])
def test_steps_without_short_rows_pass_the_step_tensors(kernels, schedule):
    """Plain decodes, alone or beside a long prefill: the step's own seq_lens and block
    table, the decodes' request ids; nothing gathered."""
    reqs = make_requests(schedule, "tiny")
    common, rows = reqs.metadata(schedule)
    md = CPUAttentionBackend(kernels).build_metadata(common)
    assert md.decodes.seq_lens is common.seq_lens
    assert md.decodes.block_table is common.block_table
    assert md.decodes.reqs is md.split.decode_reqs
    decode_rows = [r.start for r, (_, _, n) in zip(rows, schedule, strict=True) if n == 1]
    assert md.decodes.rows.tolist() == decode_rows
    assert md.long_prefill_reqs is md.split.prefill_reqs
