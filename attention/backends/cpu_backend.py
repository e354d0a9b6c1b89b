"""Paged attention on CPU with a C++ decode kernel (cpu_attn.cpp) that reads K/V in place."""

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from attention.backends.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from attention.cpp_extension import load_cpp_extension
from attention.metadata import AttentionMetadata, CommonAttentionMetadata


def load_cpu_attention() -> ModuleType | None:
    """The compiled kernel, built on first use; None when it cannot be built."""
    return load_cpp_extension("splitserve_cpu_attn", Path(__file__).with_name("cpu_attn.cpp"))


@dataclass
class CPUAttentionMetadata(TorchAttentionMetadata):
    decode_query_rows: torch.Tensor | None = None  # [num_decodes] int64: q row of each decode


class CPUAttentionBackend(TorchAttentionBackend):
    """Every decode of the step in one kernel call: no page gather, no padding to the
    longest context, each K/V row read once per GQA group, threads over (request, KV
    head). Prefills of bf16 layers without a window go to one AMX kernel call where the CPU
    has AMX (reading every context position from the cache, prefix or not); elsewhere they
    keep the torch path: fresh prompts attend to this step's k/v with SDPA's fused kernel,
    and a cached prefix is gathered once per request."""

    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self._kernels = kernels

    def build_metadata(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        split = common.compute_split()
        rows = common.query_start_loc_cpu.long()[split.decode_reqs]
        return CPUAttentionMetadata.from_common(common, split=split, decode_query_rows=rows)

    def attend(self, layer, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        assert isinstance(md, CPUAttentionMetadata), "metadata of another backend"
        if md.split.num_decodes:
            self._kernels.paged_decode(
                out,
                q,
                kv_cache,
                md.block_table,
                md.seq_lens,
                md.split.decode_reqs,
                md.decode_query_rows,
                layer.scale,
                layer.sliding_window or 0,
            )
        if md.split.num_prefills and self._amx_prefill(layer, q, kv_cache):
            self._kernels.paged_prefill(
                out,
                q,
                kv_cache,
                md.block_table,
                md.seq_lens,
                md.query_start_loc,
                md.split.prefill_reqs,
                layer.scale,
            )
            return
        for req in md.split.prefill_reqs_cpu:
            self._prefill(layer, req, q, k, v, kv_cache, md, out)

    def _amx_prefill(self, layer, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the AMX prefill kernel takes this layer's prefills (bf16, no window)."""
        return (
            q.dtype == kv_cache.dtype == torch.bfloat16
            and layer.sliding_window is None
            and layer.head_dim in (64, 128)
            and kv_cache.shape[2] % 16 == 0
            and self._kernels.has_amx_path()
        )
