"""Flash-decoding in the Triton paged attention: the split decode launch against the unsplit
one and against float64 attention over each request's gathered pages; the split-count
heuristic; and the backend's split path through the real layer. Runs on the GPU when there
is one, else under the interpreter (small contexts keep it fast)."""

import pytest
import torch
from paged_requests import PagedRequests

from attention.backends.triton_backend import (
    MAX_DECODE_SPLITS,
    DecodeLaunch,
    TritonAttentionBackend,
    decode_num_splits,
)
from attention.backends.triton_kernels import SplitPartials, paged_attention

BLOCK_SIZE = 16
BLOCK_N = 32


class DecodeBatch:
    """Decodes of the given context lengths over a random page table, in a cache of
    finite garbage; then `num_padding` rows as the CUDA-graph path pads (context 1, stale
    block table rows). Row i is request i; every row is one decode."""

    def __init__(self, seq_lens, num_kv_heads, group, head_dim, dtype, device, num_padding=0):
        gen = torch.Generator().manual_seed(sum(seq_lens) + 7 * head_dim + group)
        self.seq_lens = list(seq_lens) + [1] * num_padding
        num_rows = len(self.seq_lens)
        width = -(-max(self.seq_lens) // BLOCK_SIZE) + 1
        num_blocks = num_rows * width + 3
        table = torch.randperm(num_blocks, generator=gen)[: num_rows * width]
        self.block_table = table.view(num_rows, width).to(torch.int32)
        shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.kv_cache = torch.randn(shape, generator=gen).to(dtype)
        self.q = torch.randn(num_rows, num_kv_heads * group, head_dim, generator=gen).to(dtype)
        self.device = device

    def reference(self, scale: float, sliding_window: int | None) -> torch.Tensor:
        """Float64 attention of each row's query (at its last position) over its pages."""
        rows = []
        group = self.q.shape[1] // self.kv_cache.shape[3]
        for i, seq_len in enumerate(self.seq_lens):
            pos = torch.arange(seq_len)
            blocks = self.block_table[i, pos // BLOCK_SIZE].long()
            k, v = (self.kv_cache[j, blocks, pos % BLOCK_SIZE].double() for j in (0, 1))
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("hd,khd->hk", self.q[i].double(), k) * scale
            if sliding_window is not None:
                scores[:, pos <= seq_len - 1 - sliding_window] = float("-inf")
            rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
        return torch.stack(rows)

    def run(self, req_ids, scale, sliding_window, num_splits) -> torch.Tensor:
        """The decode launch over req_ids (rows not launched stay NaN); num_splits 1 is
        the unsplit kernel."""
        device = self.device
        q = self.q.to(device)
        out = torch.full_like(q, float("nan"))
        partials = None
        if num_splits > 1:  # more scratch rows than launched, as the backend rounds up
            rows = len(self.seq_lens) + 3
            partials = SplitPartials.empty(rows, q.shape[1], num_splits, q.shape[2], device)
            partials.max.fill_(float("nan"))
        paged_attention(
            q=q,
            out=out,
            kv_cache=self.kv_cache.to(device),
            block_table=self.block_table.to(device),
            query_start_loc=torch.arange(len(self.seq_lens) + 1, dtype=torch.int32).to(device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32).to(device),
            req_ids=torch.tensor(req_ids, dtype=torch.int64).to(device),
            max_query_len=1,
            scale=scale,
            sliding_window=sliding_window,
            block_q=1,
            block_n=BLOCK_N,
            partials=partials,
        )
        return out.cpu()


def check_split_launch(batch, num_splits, sliding_window=None, req_ids=None, tol=(2e-5, 1e-4)):
    req_ids = list(range(len(batch.seq_lens))) if req_ids is None else req_ids
    scale = batch.q.shape[2] ** -0.5
    expected = batch.reference(scale, sliding_window)[req_ids]
    split = batch.run(req_ids, scale, sliding_window, num_splits)
    whole = batch.run(req_ids, scale, sliding_window, 1)
    atol, rtol = tol
    for got in (split[req_ids], whole[req_ids]):
        torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(split[req_ids], whole[req_ids], atol=atol, rtol=rtol)
    not_launched = [i for i in range(len(batch.seq_lens)) if i not in req_ids]
    assert split[not_launched].isnan().all()


@pytest.mark.parametrize(
    "num_splits",
    # 64 splits: 8 s under the Triton interpreter (no GPU), slow there
    [2, 3, 8, pytest.param(64, marks=() if torch.cuda.is_available() else pytest.mark.slow)],
)
def test_split_counts_including_more_splits_than_blocks(kernel_device, num_splits):
    """Contexts 1..600: with 64 splits most ranges are empty, and one block is everything."""
    batch = DecodeBatch([1, 17, 33, 250, 600], 2, 1, 64, torch.float32, kernel_device)
    check_split_launch(batch, num_splits)


@pytest.mark.parametrize("group, head_dim", [(1, 128), (4, 64), (4, 128)])
def test_gqa_groups_and_head_sizes(kernel_device, group, head_dim):
    batch = DecodeBatch([5, 129, 397], 2, group, head_dim, torch.float32, kernel_device)
    check_split_launch(batch, 4)


@pytest.mark.parametrize("sliding_window", [1, 40, 100])
def test_sliding_window_empties_the_ranges_before_it(kernel_device, sliding_window):
    """Windows shorter than a key tile, than a split's range, and longer than short
    contexts; contexts that end at, before and after tile boundaries."""
    batch = DecodeBatch([3, 64, 95, 321, 577], 2, 4, 64, torch.float32, kernel_device)
    check_split_launch(batch, 6, sliding_window)


def test_padded_rows_and_shuffled_request_order(kernel_device):
    """A launch over some requests in any order, then padding rows of context 1 with
    stale table rows; rows not launched (a prefill's) are left alone."""
    batch = DecodeBatch([200, 31, 460, 90, 7], 2, 4, 64, torch.float32, kernel_device, 3)
    check_split_launch(batch, 5, req_ids=[3, 0, 4, 2, 5, 6, 7])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(kernel_device, dtype):
    if dtype == torch.bfloat16 and kernel_device == "cpu":
        pytest.skip("the Triton interpreter's tl.dot mishandles bf16 (the unsplit kernel too)")
    batch = DecodeBatch([9, 300, 600], 2, 4, 128, dtype, kernel_device, 2)
    check_split_launch(batch, 8, sliding_window=200, tol=(2e-2, 2e-2))


def test_split_count_heuristic():
    # Large batches keep the unsplit launch; it is at least 2 splits or none.
    assert decode_num_splits(128, 8, 32768, 32, target_programs=256) == 1
    assert decode_num_splits(20, 8, 32768, 32, target_programs=256) == 1
    assert decode_num_splits(16, 8, 32768, 32, target_programs=256) == 2
    # Small batches fill the target, within the cap.
    assert decode_num_splits(1, 8, 32768, 32, target_programs=256) == 32
    assert decode_num_splits(4, 2, 32768, 32, target_programs=256) == 32
    assert decode_num_splits(1, 1, 32768, 32, target_programs=256) == MAX_DECODE_SPLITS
    # Short maximum contexts get no more splits than a few key tiles each can fill.
    assert decode_num_splits(1, 8, 1024, 32, target_programs=256) == 8
    assert decode_num_splits(1, 8, 128, 32, target_programs=256) == 1
    assert decode_num_splits(0, 8, 4096, 32) == 1


def test_split_count_fills_but_never_overfills_the_target():
    for num_decodes in range(1, 65):
        for kv_heads in (1, 2, 4, 8):
            splits = decode_num_splits(num_decodes, kv_heads, 1 << 15, 32, target_programs=256)
            programs = num_decodes * kv_heads
            assert splits * programs <= max(256, programs)
            if splits == 1:
                assert programs > 128
            elif splits < MAX_DECODE_SPLITS:
                assert (splits + 1) * programs > 256


def test_backend_splits_small_decode_batches(kernel_device):
    """Through the layer: decodes after a prefill in one step, the backend splitting (a
    few programs to fill) or not; scratch is kept per shape and reused step after step."""
    seq_lens = [70, 3, 129, 41]
    reqs = PagedRequests(seq_lens, 8, 2, 16, 4, sliding_window=50, device=kernel_device)
    schedule = [(0, 60, 10)] + [(i, n - 1, 1) for i, n in enumerate(seq_lens) if i]
    for req, start, _ in schedule:
        reqs.cache_prefix(req, start)
    backend = TritonAttentionBackend(prefill_block_q=8, block_n=16, target_decode_programs=48)
    num_splits = decode_num_splits(3, 2, reqs.block_table.shape[1] * 4, 16, 48)
    assert num_splits >= 3
    ref = TritonAttentionBackend(prefill_block_q=8, block_n=16, target_decode_programs=1)
    for _ in range(2):
        outs = reqs.run_step(backend, schedule, num_padding=2)
        for (req, start, query_len), out in zip(schedule, outs, strict=True):
            expected = reqs.expected(req, start, query_len).to(out.dtype)
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
        assert list(backend._partials) == [(4, 8, num_splits, 16, reqs.kv_cache.device)]
    assert not ref._partials
    unsplit = reqs.run_step(ref, schedule, num_padding=2)
    for out, expected in zip(outs, unsplit, strict=True):
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "launch",
    [DecodeLaunch(16, num_warps=2, num_stages=1), DecodeLaunch(64, num_warps=8, num_stages=3)],
    ids=str,
)
@pytest.mark.parametrize("target_programs", [1, 48])
def test_decode_launch_options(kernel_device, launch, target_programs):
    """The decode launch's tile width, warps and stages (attention_bench --sweep's
    choices), split or not, attend as the float64 reference does."""
    seq_lens = [70, 3, 300, 41]
    reqs = PagedRequests(seq_lens, 8, 2, 16, 4, device=kernel_device)
    schedule = [(i, n - 1, 1) for i, n in enumerate(seq_lens)]
    max_context = reqs.block_table.shape[1] * 4
    num_splits = decode_num_splits(4, 2, max_context, launch.block_n, target_programs)
    assert (num_splits > 1) == (target_programs > 1)
    for req, start, _ in schedule:
        reqs.cache_prefix(req, start)
    backend = TritonAttentionBackend(target_decode_programs=target_programs, decode=launch)
    outs = reqs.run_step(backend, schedule, num_padding=2)
    for (req, start, query_len), out in zip(schedule, outs, strict=True):
        expected = reqs.expected(req, start, query_len).to(out.dtype)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    assert [key[2] for key in backend._partials] == ([num_splits] if num_splits > 1 else [])
