"""Test helpers: requests with random full sequences whose K/V live in a paged cache, steps
built from (request, context length, query length), and plain causal attention over each
request's whole, unpaged sequence as the independent reference."""

import torch

from attention import Attention, AttentionBackend, CommonAttentionMetadata, set_forward_context
from ipc.utils import cdiv


def reference_attention(q, k, v, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Causal attention of one whole sequence: q [L, H, D], k/v [L, Hkv, D] -> [L, H, D]."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    dist = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    visible = dist >= 0
    if sliding_window is not None:
        visible &= dist < sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def random_pages(seq_lens, kv_heads, head_dim, block_size, dtype, gen, spare_per_req, spare):
    """A cache of random pages, and a block table giving each request scattered pages for
    its tokens plus `spare_per_req`, out of `spare` more pages than the table names."""
    num_reqs = len(seq_lens)
    max_blocks = cdiv(max(seq_lens), block_size) + spare_per_req
    num_blocks = num_reqs * max_blocks + spare
    table = torch.randperm(num_blocks, generator=gen)[: num_reqs * max_blocks]
    table = table.view(num_reqs, max_blocks).to(torch.int32)
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), table


def strided_q(num_rows, heads, kv_heads, head_dim, dtype, gen):
    """Random q [num_rows, heads, head_dim] as the q part of fused QKV rows (strided)."""
    fused = torch.randn(num_rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    return fused[:, : heads * head_dim].view(num_rows, heads, head_dim)


class PagedRequests:
    """Requests of the given total lengths, with random q/k/v for every position and
    random, non-contiguous blocks drawn from a cache of num_blocks pages filled with
    finite garbage (anything read outside a request's context would show). The cache and
    each step's tensors live on `device`; the reference stays on the CPU."""

    def __init__(
        self,
        seq_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int = 2000,
        sliding_window: int | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.block_size = block_size
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        blocks_per_req = cdiv(max(seq_lens), block_size) + 1
        ids = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * blocks_per_req]
        self.block_table = ids.view(len(seq_lens), blocks_per_req).to(torch.int32)
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cache = (torch.randn(shape, generator=gen) * 10).to(dtype).to(self.device)
        self.layer = Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, sliding_window)
        self.layer.kv_cache = self.kv_cache

    def cache_prefix(self, req: int, length: int) -> None:
        """Put positions [0, length) of a request into the cache, token by token."""
        for pos in range(length):
            block = int(self.block_table[req, pos // self.block_size])
            self.kv_cache[0, block, pos % self.block_size] = self.k[req][pos]
            self.kv_cache[1, block, pos % self.block_size] = self.v[req][pos]

    def expected(self, req: int, start: int, query_len: int) -> torch.Tensor:
        full = reference_attention(
            self.q[req],
            self.k[req],
            self.v[req],
            self.layer.spec.scale,
            self.layer.spec.sliding_window,
        )
        return full[start : start + query_len]

    def run_step(
        self, backend: AttentionBackend, schedule: list[tuple[int, int, int]], num_padding: int = 0
    ) -> list[torch.Tensor]:
        """One step through the Attention layer: schedule lists (request, context length
        before the step, query length) in batch order; query_len 0 is a padding request.
        Returns each entry's output rows, on the CPU."""
        common, rows = self.metadata(schedule, num_padding)
        metadata = backend.build_metadata(common)

        def batch(xs: list[torch.Tensor]) -> torch.Tensor:
            pad = torch.randn(num_padding, xs[0][0].numel()).to(xs[0].dtype)
            pieces = [xs[req][start : start + n].flatten(1) for req, start, n in schedule]
            return torch.cat(pieces + [pad])

        q, k, v = batch(self.q), batch(self.k), batch(self.v)
        qkv = torch.cat([q, k, v], dim=1).to(
            self.device
        )  # the layer gets strided views, as from a QKV proj
        q, k, v = qkv.split([q.shape[1], k.shape[1], v.shape[1]], dim=1)
        with set_forward_context([metadata], backend):
            out = self.layer(q, k, v)
        out = out.view(out.shape[0], self.layer.spec.num_heads, self.layer.spec.head_size)
        assert out[metadata.num_actual_tokens :].eq(0).all()
        return [out[r].cpu() for r in rows]

    def metadata(self, schedule: list[tuple[int, int, int]], num_padding: int = 0):
        """The step's batch (slots computed token by token) and each entry's row range."""
        query_lens = [n for _, _, n in schedule]
        seq_lens = [start + n for _, start, n in schedule]
        starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
        slots = []
        for req, start, n in schedule:
            for pos in range(start, start + n):
                block = int(self.block_table[req, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
        num_tokens = len(slots)
        device = self.device
        common = CommonAttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=starts.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=self.block_table[[req for req, _, _ in schedule]].to(device),
            slot_mapping=torch.tensor(slots + [-1] * num_padding, device=device),
            query_start_loc_cpu=starts.clone(),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )
        rows = [slice(int(starts[i]), int(starts[i + 1])) for i in range(len(schedule))]
        return common, rows
