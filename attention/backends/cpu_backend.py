"""Paged attention on CPU with a C++ decode kernel (cpu_attn.cpp) that reads K/V in place."""

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from attention.backends.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from attention.metadata import AttentionMetadata, CommonAttentionMetadata
from kernels import KernelSet
from kernels.libraries import ATTENTION

# Rows of 2..SHORT_QUERY_LEN query tokens (speculative verification, short chunk tails)
# are attended by the decode kernel, one entry per query token; longer rows are prefills.
SHORT_QUERY_LEN = 8


def load_cpu_attention(kernels: KernelSet) -> ModuleType | None:
    """The compiled kernels for the set's ISA, built on first use; None where the set has
    the C++ kernels off or they cannot be built."""
    return kernels.cpp(ATTENTION)


@dataclass(frozen=True)
class DecodeEntries:
    """The decode kernel's work, as `paged_decode` takes it: entry i writes query row
    rows[i], attending to the first seq_lens[reqs[i]] positions of block table row
    reqs[i]. A step whose rows are all single tokens or long prefills passes the step's
    own seq_lens and block table, and its decodes' request ids. A step with short rows
    has one entry per query token of its decodes and short rows, each with its own
    seq_len and block-table row (reqs = arange)."""

    seq_lens: torch.Tensor  # int32
    block_table: torch.Tensor  # [*, max_blocks] int32
    reqs: torch.Tensor  # [n] int64
    rows: torch.Tensor  # [n] int64

    @property
    def num(self) -> int:
        return self.rows.shape[0]


@dataclass(kw_only=True)
class CPUAttentionMetadata(TorchAttentionMetadata):
    """The torch backend's metadata (whose split keeps every multi-token row a prefill)
    plus this backend's division of the step: the decode kernel's entries, and the
    requests of more than SHORT_QUERY_LEN query tokens, which take the prefill paths."""

    decodes: DecodeEntries
    long_prefill_reqs: torch.Tensor  # [num_long] int64
    long_prefill_reqs_cpu: list[int]


def short_row_entries(common: CommonAttentionMetadata) -> DecodeEntries:
    """One entry per query token of every row of 1..SHORT_QUERY_LEN tokens: token j of a
    row of q tokens and seq_len s is a decode of seq_len s - q + 1 + j, which sees the
    context up to and including itself (causal), its window ending there too."""
    starts = common.query_start_loc_cpu.numpy().astype(np.int64)
    query_lens = np.diff(starts)
    reqs = np.flatnonzero((query_lens >= 1) & (query_lens <= SHORT_QUERY_LEN))
    lens = query_lens[reqs]
    entry_reqs = np.repeat(reqs, lens)
    token = np.arange(len(entry_reqs)) - np.repeat(np.cumsum(lens) - lens, lens)
    seq_lens = common.seq_lens_cpu.numpy()[entry_reqs] - np.repeat(lens, lens) + 1 + token
    return DecodeEntries(
        torch.from_numpy(seq_lens.astype(np.int32)),
        common.block_table.index_select(0, torch.from_numpy(entry_reqs)),
        torch.arange(len(entry_reqs)),
        torch.from_numpy(starts[entry_reqs] + token),
    )


class CPUAttentionBackend(TorchAttentionBackend):
    """Every decode of the step in one kernel call: no page gather, no padding to the
    longest context, each K/V row read once per GQA group, threads over (request, KV
    head). Rows of 2..SHORT_QUERY_LEN query tokens (a speculative step's verification,
    a short chunk) join that call as one decode per query token (`short_row_entries`),
    their own K/V read back from the pages as stored (fp8: rounded).
    The step's longer prefills go to one prefill kernel call, reading every context
    position from the cache, prefix or not: AMX for bf16 layers without a window on a CPU
    with AMX, AVX2 (float32 math) for the rest from AVX2 up, head sizes 64 and 128. What
    it declines (it says so) keeps the torch path: fresh prompts attend to this step's k/v
    with SDPA's fused kernel, and a cached prefix is gathered once per request. K/V are
    stored by a C++ row copy. fp8 pages are read and written by every kernel here
    (cpu_attn_fp8.h)."""

    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self._kernels = kernels

    def build_metadata(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        split = common.compute_split()
        long_reqs, long_reqs_cpu = split.prefill_reqs, split.prefill_reqs_cpu
        decodes = None
        if split.num_prefills:
            query_lens = np.diff(common.query_start_loc_cpu.numpy())
            prefills = np.asarray(split.prefill_reqs_cpu, dtype=np.int64)
            longs = prefills[query_lens[prefills] > SHORT_QUERY_LEN]
            if len(longs) < len(prefills):
                decodes = short_row_entries(common)
                long_reqs, long_reqs_cpu = torch.from_numpy(longs), longs.tolist()
        if decodes is None:  # no short rows: the step's own tensors, nothing copied
            rows = common.query_start_loc_cpu.long()[split.decode_reqs]
            decodes = DecodeEntries(common.seq_lens, common.block_table, split.decode_reqs, rows)
        return CPUAttentionMetadata.from_common(
            common,
            split=split,
            decodes=decodes,
            long_prefill_reqs=long_reqs,
            long_prefill_reqs_cpu=long_reqs_cpu,
        )

    def store_kv(self, k, v, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        if not self._kernels.store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale):
            super().store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def attend(self, spec, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        assert isinstance(md, CPUAttentionMetadata), "metadata of another backend"
        window = spec.sliding_window or 0
        decodes = md.decodes
        if decodes.num:
            self._kernels.paged_decode(
                out,
                q,
                kv_cache,
                decodes.block_table,
                decodes.seq_lens,
                decodes.reqs,
                decodes.rows,
                spec.scale,
                window,
                spec.k_scale,
                spec.v_scale,
            )
        if md.long_prefill_reqs_cpu and self._kernels.paged_prefill(
            out,
            q,
            kv_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            md.long_prefill_reqs,
            spec.scale,
            window,
            spec.k_scale,
            spec.v_scale,
        ):
            return
        for req in md.long_prefill_reqs_cpu:
            self._prefill(spec, req, q, k, v, kv_cache, md, out)
