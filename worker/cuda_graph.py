"""CUDA graphs of pure-decode batches, padded to a few captured sizes.

A decode step of n requests (one token each) is padded to the smallest captured size
>= n: the step's inputs are copied into the first n rows of static buffers and the
other rows become harmless one-token requests (token 0 at position 0, seq_len 1, so
they read one valid cache slot; slot -1, so they write nothing). The graph of that
size replays over the static buffers and the first n rows of the static output are
the step's hidden states. Prefills, mixed steps and batches larger than the largest
size run eagerly.

Each size's AttentionMetadata is built once, over views of the static buffers, with
the host-side fields at safe upper bounds (every row a decode of up to max_model_len
tokens) and its batch split computed before capture, so no host value or host-to-device
copy is baked into a graph. The backend's decode path must then depend only on device
values and the padded batch size: `cudagraph_support` on each backend says whether it does.

Mode "cuda_graph" warms up and captures every size, largest first, into one shared
memory pool. Mode "padded_eager" captures nothing and runs the model eagerly on the
padded static buffers: the same padding and metadata on any device (the CPU tests).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Literal

import torch

from attention import AttentionMetadata, set_forward_context
from worker.slot_mapping import PAD_SLOT_ID

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

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


class CudaGraphRunner:
    """Static decode buffers, one metadata per captured size, and (on CUDA) the graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend,
        sizes: list[int],
        *,
        max_model_len: int,
        max_num_blocks_per_req: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        mode: Mode = "cuda_graph",
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive integers, got {sizes}")
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.mode = mode
        n = self.max_size

        def buffer(shape, fill: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        self.input_ids = buffer((n,), 0, torch.long)
        self.positions = buffer((n,), 0, torch.long)
        self.seq_lens = buffer((n,), 1, torch.int32)
        self.slot_mapping = buffer((n,), PAD_SLOT_ID, torch.long)
        self.block_table = buffer((n, max_num_blocks_per_req), 0, torch.int32)
        # Every row, padding included, is a one-token request: this never changes.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self.output = buffer((n, hidden_size), 0, dtype)
        self.metadata: dict[int, AttentionMetadata] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @classmethod
    def for_model_runner(cls, runner: ModelRunner, mode: Mode = "cuda_graph") -> CudaGraphRunner:
        config = runner.config
        sizes = config.cuda_graph_sizes or default_capture_sizes(
            config.max_num_seqs, config.max_num_batched_tokens
        )
        return cls(
            runner.model,
            runner.attn_backend,
            sizes,
            max_model_len=config.max_model_len,
            max_num_blocks_per_req=runner.input_batch.block_table.max_num_blocks_per_req,
            hidden_size=runner.hf_config.hidden_size,
            dtype=runner.dtype,
            device=runner.device,
            mode=mode,
        )

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size >= num_reqs; None past the largest."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, md: AttentionMetadata) -> bool:
        """A pure-decode step (one token per request) within the largest size."""
        return md.max_query_len == 1 and md.num_actual_tokens == md.num_reqs <= self.max_size

    def capture(self) -> None:
        for size in self.sizes:
            md = self._metadata(size)
            _ = md.split  # its host-to-device copies happen now, never inside a capture
            self.metadata[size] = md
        if self.mode == "cuda_graph":
            self._capture_graphs()

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [n, hidden_size] of a decode step that `can_run`. The result is a
        view of the static output: read it before the next call."""
        n = md.num_actual_tokens
        size = self.padded_size(n)
        for static, values, pad in (
            (self.input_ids, input_ids, 0),
            (self.positions, positions, 0),
            (self.seq_lens, md.seq_lens, 1),
            (self.slot_mapping, md.slot_mapping[:n], PAD_SLOT_ID),
        ):
            static[:n].copy_(values)
            static[n:size].fill_(pad)
        # Padding rows keep earlier rows' block ids: any valid id is fine for seq_len 1.
        self.block_table[:n].copy_(md.block_table[:n])
        if self.mode == "cuda_graph":
            self.graphs[size].replay()
        else:
            self._forward(size)
        return self.output[:n]

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
        )

    def _forward(self, size: int) -> None:
        with set_forward_context(self.metadata[size], self.attn_backend):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
        self.output[:size].copy_(hidden)

    def _capture_graphs(self) -> None:
        """Warm up (Triton compiles, cuBLAS handles, lazy allocations) and capture on one
        side stream, largest size first, so the smaller graphs reuse the pool's memory."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
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


def capture_decode_graphs(runner: ModelRunner) -> CudaGraphRunner | None:
    """The runner's captured decode graphs, or None when it runs every step eagerly."""
    if runner.device.type != "cuda":
        return None
    if runner.config.enforce_eager:
        logger.info("CUDA graphs off: enforce_eager")
        return None
    if not runner.attn_backend.cudagraph_support:
        logger.info("CUDA graphs off: the %s attention backend has none", runner.attn_backend.name)
        return None
    graphs = CudaGraphRunner.for_model_runner(runner)
    graphs.capture()
    return graphs
