"""CUDA graphs of pure-decode batches, padded to a few captured sizes.

A decode step of n requests (one token each) is padded to the smallest captured size
>= n: the ModelRunner writes the step's inputs into the first n rows of its persistent
buffers (InputBuffers and the block table's device tensor) and makes the other rows
harmless one-token requests (token 0 at position 0, seq_len 1, so they read one valid
cache slot; slot -1, so they write nothing). The graph of that size replays over views
of those same buffers, and the first n rows of the static output are the step's hidden
states. Prefills, mixed steps and batches larger than the largest size run eagerly.

Each size's attention metadata is built once (`AttentionBackend.build_cudagraph_metadata`)
over views of the buffers, with the host-side fields at safe upper bounds (every row a
decode of up to max_model_len tokens), so no host value or host-to-device copy is baked
into a graph. The backend's decode path must then depend only on device values and the
padded batch size: `cudagraph_support` on each backend says whether it does.

Mode "cuda_graph" warms up and captures every size, largest first, into one shared
memory pool. Mode "padded_eager" captures nothing and runs the model eagerly over the
same padded buffers and metadata, on any device (the CPU tests).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch

from attention import (
    AttentionBackend,
    AttentionMetadata,
    CommonAttentionMetadata,
    set_forward_context,
)
from worker.buffers import InputBuffers
from worker.slot_mapping import PAD_SLOT_ID

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
_NUM_WARMUP_RUNS = 2

Mode = Literal["cuda_graph", "padded_eager"]


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """[1, 2, 4] and multiples of 8, up to the first that covers every decode batch
    (min(max_num_seqs, max_num_batched_tokens, 512) requests)."""
    largest_batch = min(max_num_seqs, max_num_batched_tokens, MAX_CAPTURE_SIZE)
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= largest_batch:
            break
    return sizes


def capture_sizes(requested: list[int] | None, max_num_reqs: int, max_num_tokens: int) -> list[int]:
    """The sizes to capture: `requested` (default_capture_sizes when None), each cut to
    the largest decode batch, which is also as many rows as the buffers hold."""
    largest_batch = min(max_num_reqs, max_num_tokens)
    sizes = requested or default_capture_sizes(max_num_reqs, max_num_tokens)
    return sorted({min(size, largest_batch) for size in sizes})


def cuda_graphs_off_reason(
    device: torch.device, enforce_eager: bool, backend: AttentionBackend
) -> str | None:
    """Why decode steps cannot replay CUDA graphs here, or None when they can."""
    if device.type != "cuda":
        return "not on a CUDA device"
    if enforce_eager:
        return "enforce_eager"
    if not backend.cudagraph_support:
        return f"the {backend.name} attention backend has none"
    return None


class CudaGraphRunner:
    """One metadata per captured size over the persistent buffers, and (on CUDA) the
    graphs. The caller writes and pads each step's inputs (`padded_size` says to what)."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        buffers: InputBuffers,
        block_tables: Sequence[torch.Tensor],
        sizes: list[int],
        *,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        mode: Mode = "cuda_graph",
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive integers, got {sizes}")
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        capacity = min(buffers.max_num_reqs, buffers.max_num_tokens, block_tables[0].shape[0])
        if self.max_size > capacity:
            raise ValueError(f"capture size {self.max_size} exceeds the buffers' {capacity} rows")
        self.model = model
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.block_tables = list(block_tables)  # one per KV cache group
        self.max_model_len = max_model_len
        self.device = block_tables[0].device
        self.mode = mode
        self.output = torch.zeros(self.max_size, hidden_size, dtype=dtype, device=self.device)
        self.metadata: dict[int, list[AttentionMetadata]] = {}  # per group
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size >= num_reqs; None past the largest."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self) -> None:
        """Build every size's metadata, then (mode "cuda_graph") capture the graphs. The
        buffers hold an all-padding batch meanwhile, so warm-up runs read valid slots."""
        self._fill_with_padding()
        for size in self.sizes:
            self.metadata[size] = [
                self.attn_backend.build_cudagraph_metadata(self._common(size, group))
                for group in range(len(self.block_tables))
            ]
        if self.mode == "cuda_graph":
            self._capture_graphs()

    def run(self, size: int) -> torch.Tensor:
        """Hidden states [size, hidden_size] of the padded decode batch in the buffers.
        The result is a view of the static output: read it before the next call."""
        for md in self.metadata[size]:
            self.attn_backend.prepare_replay(md)
        if self.mode == "cuda_graph":
            self.graphs[size].replay()
        else:
            self._forward(size)
        return self.output[:size]

    def _fill_with_padding(self) -> None:
        buffers, n = self.buffers, self.max_size
        buffers.wait_for_copies()
        buffers.query_start_loc.np[0] = 0
        buffers.pad_decodes(0, n)
        for buffer in (buffers.input_ids, buffers.positions, buffers.seq_lens):
            buffer.commit(n)
        buffers.query_start_loc.commit(n + 1)
        buffers.slot_mapping[:, :n].fill_(PAD_SLOT_ID)
        buffers.copy_to_device()

    def _common(self, size: int, group: int) -> CommonAttentionMetadata:
        buffers = self.buffers
        return CommonAttentionMetadata(
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=buffers.query_start_loc.gpu[: size + 1],
            seq_lens=buffers.seq_lens.gpu[:size],
            block_table=self.block_tables[group][:size],
            slot_mapping=buffers.slot_mapping[group, :size],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
        )

    def _forward(self, size: int) -> None:
        buffers = self.buffers
        with set_forward_context(self.metadata[size], self.attn_backend):
            hidden = self.model(buffers.input_ids.gpu[:size], buffers.positions.gpu[:size])
        self.output[:size].copy_(hidden)

    def _capture_graphs(self) -> None:
        """Warm up (Triton compiles, cuBLAS handles, lazy allocations) and capture on one
        side stream, largest size first, so the smaller graphs reuse the pool's memory."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with _gc_frozen(), torch.inference_mode(), torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                for _ in range(_NUM_WARMUP_RUNS):
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(size)
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for decode batches of %s requests in %.1f s",
            self.sizes,
            time.perf_counter() - start,
        )


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """torch.cuda.graph runs gc.collect() as each capture begins. With the heap frozen
    after one collection, those walk only the objects made since, not every module,
    tensor and tokenizer object of the process (35 full collections otherwise)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
