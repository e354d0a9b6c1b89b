"""Paged attention on CPU with a C++ decode kernel (cpu_attn.cpp) that reads K/V in place."""

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from attention.backends.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from attention.metadata import AttentionMetadata, CommonAttentionMetadata
from kernels import KernelSet
from kernels.build import cpp_extension

_EXTENSION = cpp_extension("splitserve_cpu_attn", Path(__file__).with_name("cpu_attn.cpp"))


def load_cpu_attention(kernels: KernelSet) -> ModuleType | None:
    """The compiled kernels for the set's ISA, built on first use; None where the set has
    the C++ kernels off or they cannot be built."""
    return kernels.cpp(_EXTENSION)


@dataclass
class CPUAttentionMetadata(TorchAttentionMetadata):
    decode_query_rows: torch.Tensor | None = None  # [num_decodes] int64: q row of each decode


class CPUAttentionBackend(TorchAttentionBackend):
    """Every decode of the step in one kernel call: no page gather, no padding to the
    longest context, each K/V row read once per GQA group, threads over (request, KV
    head). The step's prefills go to one AMX kernel call where the kernel takes them (it
    says so: bf16 layers without a window, on a CPU with AMX), reading every context
    position from the cache, prefix or not; elsewhere they keep the torch path: fresh
    prompts attend to this step's k/v with SDPA's fused kernel, and a cached prefix is
    gathered once per request. K/V are stored by a C++ row copy. fp8 pages are read and
    written by every kernel here (cpu_attn_fp8.h)."""

    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self._kernels = kernels

    def build_metadata(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        split = common.compute_split()
        rows = common.query_start_loc_cpu.long()[split.decode_reqs]
        return CPUAttentionMetadata.from_common(common, split=split, decode_query_rows=rows)

    def store_kv(self, k, v, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        if not self._kernels.store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale):
            super().store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def attend(self, spec, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        assert isinstance(md, CPUAttentionMetadata), "metadata of another backend"
        window = spec.sliding_window or 0
        if md.split.num_decodes:
            self._kernels.paged_decode(
                out,
                q,
                kv_cache,
                md.block_table,
                md.seq_lens,
                md.split.decode_reqs,
                md.decode_query_rows,
                spec.scale,
                window,
                spec.k_scale,
                spec.v_scale,
            )
        if md.split.num_prefills and self._kernels.paged_prefill(
            out,
            q,
            kv_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            md.split.prefill_reqs,
            spec.scale,
            window,
            spec.k_scale,
            spec.v_scale,
        ):
            return
        for req in md.split.prefill_reqs_cpu:
            self._prefill(spec, req, q, k, v, kv_cache, md, out)
