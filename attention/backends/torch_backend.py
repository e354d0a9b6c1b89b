"""Paged attention with torch ops: the CPU default and the reference for the other backends."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F

from attention.backends.base import AttentionBackend
from attention.batch_split import DecodeGroup
from attention.kv_cache_dtype import dequantize_fp8, is_fp8
from attention.metadata import AttentionMetadata, CommonAttentionMetadata
from attention.spec import AttentionSpec
from ipc.utils import cdiv

Window = int | None
_K = TypeVar("_K")
_V = TypeVar("_V")


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The step's metadata plus the layouts every layer of a forward pass shares, built by
    the first layer that needs one: decode page ids and masks per (decode group, window)
    and prefill masks per (request, window). Decode layouts read device values (seq_lens,
    the block table), so `TorchAttentionBackend.prepare_replay` drops them before a pass
    over rewritten buffers."""

    decode_layouts: dict[tuple[int, Window], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    prefill_masks: dict[tuple[int, Window], torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's context pages from the cache by its block table and calls
    `scaled_dot_product_attention`.

    Decodes go in a few calls, grouped by context length (see BatchSplit.decode_groups):
    [group size, num_blocks * block_size] pages, masked past each seq_len (and before
    its window). The query heads that share a KV head are
    folded into the query-length axis ([num_decodes, kv_heads, group, head_dim]), which
    is exact for one query token and lets SDPA use its fused kernel without repeating
    K/V. Prefills run one SDPA per request; a prompt with no cached prefix attends to
    this step's k/v directly, with no gather.

    Gathered pages land in a reused workspace: fresh multi-MB buffers every layer cost
    more in page faults on CPU than the gather itself. Block table entries past a
    request's blocks must be valid block ids (0 is fine), and the cache must hold
    finite values (zero-initialised): masked-out slots are read but get zero weight.
    """

    name = "torch"
    # The decode gather is sized by the host-side max_decode_seq_len: captured at its upper
    # bound it would gather max_model_len tokens per request on every replay.
    cudagraph_support = False

    def __init__(self) -> None:
        self._workspace: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionMetadata.from_common(common, split=common.compute_split())

    def prepare_replay(self, md: AttentionMetadata) -> None:
        assert isinstance(md, TorchAttentionMetadata)
        md.decode_layouts.clear()
        md.prefill_masks.clear()

    def attend(self, spec, q, k, v, kv_cache, md: AttentionMetadata, out) -> None:
        assert isinstance(md, TorchAttentionMetadata), "metadata of another backend"
        for index, group in enumerate(md.split.decode_groups):
            self._decode(spec, q, kv_cache, md, out, index, group)
        for req in md.split.prefill_reqs_cpu:
            self._prefill(spec, req, q, k, v, kv_cache, md, out)

    def _decode(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: TorchAttentionMetadata,
        out: torch.Tensor,
        index: int,
        group: DecodeGroup,
    ) -> None:
        num_decodes, block_size = group.reqs.shape[0], kv_cache.shape[2]
        block_ids, valid = _shared(
            md.decode_layouts,
            (index, spec.sliding_window),
            lambda: _decode_layout(md, group, spec.sliding_window, block_size),
        )
        keys, values = self._gather(spec, kv_cache, block_ids, q.dtype)
        shape = (num_decodes, valid.shape[-1], spec.num_kv_heads, spec.head_size)
        query = q[group.rows].view(num_decodes, spec.num_kv_heads, -1, spec.head_size)
        result = F.scaled_dot_product_attention(
            query,
            keys.view(shape).transpose(1, 2),
            values.view(shape).transpose(1, 2),
            attn_mask=valid,
            scale=spec.scale,
        )
        out[group.rows] = result.reshape(num_decodes, spec.num_heads, spec.head_size)

    def _prefill(
        self, spec: AttentionSpec, req: int, q, k, v, kv_cache, md: TorchAttentionMetadata, out
    ) -> None:
        start = int(md.query_start_loc_cpu[req])
        end = int(md.query_start_loc_cpu[req + 1])
        seq_len = int(md.seq_lens_cpu[req])
        query_len, window = end - start, spec.sliding_window
        first = 0 if window is None else max(0, seq_len - query_len - window + 1)
        if seq_len == query_len:
            keys, values = k[start:end], v[start:end]
        else:
            block_size = kv_cache.shape[2]
            first -= first % block_size
            blocks = md.block_table[req, first // block_size : cdiv(seq_len, block_size)]
            keys, values = self._gather(spec, kv_cache, blocks, q.dtype)
            heads = (-1, spec.num_kv_heads, spec.head_size)
            keys = keys.view(heads)[: seq_len - first]
            values = values.view(heads)[: seq_len - first]
        mask = None
        if seq_len > query_len or window is not None:
            mask = _shared(
                md.prefill_masks,
                (req, window),
                lambda: _prefill_mask(seq_len, query_len, first, window, q.device),
            )
        # 4-D inputs: on CPU only those reach SDPA's fused kernel (3-D ones take the
        # math path, ~5-9x slower for a few hundred tokens).
        result = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=spec.scale,
            enable_gqa=True,
        )
        out[start:end] = result[0].transpose(0, 1)

    def _gather(
        self, spec: AttentionSpec, kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of block_ids ([n] ids -> two [n, block_size, heads, dim] tensors),
        fp8 pages read as `dtype` times the layer's scales."""
        page_shape = kv_cache.shape[2:]
        numel = 2 * block_ids.numel() * page_shape.numel()
        key = (kv_cache.dtype, kv_cache.device)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
            self._workspace[key] = buffer
        pages = buffer[:numel].view(2, block_ids.numel(), *page_shape)
        torch.index_select(kv_cache[0], 0, block_ids, out=pages[0])
        torch.index_select(kv_cache[1], 0, block_ids, out=pages[1])
        if is_fp8(kv_cache.dtype):
            keys = dequantize_fp8(pages[0], spec.k_scale, dtype)
            return keys, dequantize_fp8(pages[1], spec.v_scale, dtype)
        return pages[0], pages[1]


def _prefill_mask(
    seq_len: int, query_len: int, first: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Query positions seq_len - query_len .. seq_len - 1 against key positions
    first .. seq_len - 1: causal, and within the window if there is one."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(first, seq_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


def _shared(layouts: dict[_K, _V], key: _K, build: Callable[[], _V]) -> _V:
    """layouts[key], built on first use: the first layer of a pass builds what the others
    reuse."""
    if key not in layouts:
        layouts[key] = build()
    return layouts[key]


def _decode_layout(
    md: AttentionMetadata, group: DecodeGroup, window: Window, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages a decode group gathers (flat block ids) and which gathered positions it
    may attend to ([n, 1, 1, ctx] mask)."""
    num_decodes = group.reqs.shape[0]
    seq_lens = md.seq_lens[group.reqs].long()
    num_blocks = cdiv(group.max_seq_len, block_size)
    if window is not None:  # a window of w tokens spans at most cdiv(w - 1, bs) + 1 pages
        num_blocks = min(num_blocks, cdiv(window - 1, block_size) + 1)
    device = md.block_table.device
    cols = torch.arange(num_blocks, device=device).expand(num_decodes, num_blocks)
    if window is not None:
        cols = cols + ((seq_lens - window).clamp(min=0) // block_size)[:, None]
    block_ids = md.block_table[group.reqs].gather(1, cols.clamp(max=md.block_table.shape[1] - 1))
    positions = cols[:, :, None] * block_size + torch.arange(block_size, device=device)
    positions = positions.view(num_decodes, num_blocks * block_size)
    valid = positions < seq_lens[:, None]
    if window is not None:
        valid &= positions >= (seq_lens - window)[:, None]
    return block_ids.flatten(), valid[:, None, None, :]
