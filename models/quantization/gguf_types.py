"""A GGUF tensor as stored (its raw ggml blocks), and its conversion to BlockQuantWeight.

Each ggml type packs a row of K weights into K // block_elems blocks of block_bytes. The
conversions are exact: `to_block_quant().dequantize()` equals ggml's dequantization in
float32 (K-quant sub-block scales d * sc and mins -dmin * m are exact in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.quantization.block_quant import BlockQuantWeight, pack_int4

QK_K = 256  # elements per K-quant super-block


@dataclass(frozen=True)
class GGUFWeight:
    """A quantized GGUF tensor: `data` is uint8 [N, row_bytes] (a view of the mapped file),
    `shape` the logical (N out_features, K in_features), `name` says which for errors."""

    ggml_type: str
    data: torch.Tensor
    shape: tuple[int, int]
    name: str = ""

    @property
    def block_geometry(self) -> tuple[int, int]:
        """(elements, bytes) of one ggml block."""
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.ggml_type]]

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows (dim 0) or input features (dim 1, on whole ggml blocks) start:start+length."""
        n, k = self.shape
        if dim == 0:
            data = self.data.narrow(0, start, length)
            return GGUFWeight(self.ggml_type, data, (length, k), self.name)
        elems, nbytes = self.block_geometry
        if start % elems or length % elems:
            raise ValueError(
                f"{self.name}: input features {start}:{start + length} do not fall on whole "
                f"{self.ggml_type} blocks of {elems}"
            )
        data = self.data.narrow(1, start // elems * nbytes, length // elems * nbytes)
        return GGUFWeight(self.ggml_type, data, (n, length), self.name)

    def to_block_quant(self, name: str | None = None) -> BlockQuantWeight:
        """The weight as a BlockQuantWeight; ValueError naming the tensor (`name`, default
        self.name) for a type without a conversion."""
        convert = _CONVERSIONS.get(self.ggml_type)
        if convert is None:
            raise ValueError(
                f"GGUF tensor {name or self.name} has type {self.ggml_type}, which is not "
                f"supported; supported: {', '.join(_CONVERSIONS)}"
            )
        n, k = self.shape
        elems, nbytes = self.block_geometry
        return convert(self.data.reshape(n, k // elems, nbytes))


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from its 2 bytes (the last dim) -> float16 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _q8_0(blocks: torch.Tensor) -> BlockQuantWeight:
    n, nb, _ = blocks.shape
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, nb * 32)
    return BlockQuantWeight(8, q, _f16(blocks[..., :2]), None, 32)


def _q4_0(blocks: torch.Tensor) -> BlockQuantWeight:
    n, nb, _ = blocks.shape
    d = _f16(blocks[..., :2])
    mins = -8 * d.float()
    if mins.abs().max() <= torch.finfo(torch.float16).max:
        mins = mins.half()
    else:  # -8 * d overflows float16: keep both in float32
        d = d.float()
    # Q4_0's 16 bytes per block are pack_int4's layout: element i low, i + 16 high.
    return BlockQuantWeight(4, blocks[..., 2:].reshape(n, nb * 16), d, mins, 32)


def _q4_1(blocks: torch.Tensor) -> BlockQuantWeight:
    n, nb, _ = blocks.shape
    d, m = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    return BlockQuantWeight(4, blocks[..., 4:].reshape(n, nb * 16), d, m, 32)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit values, uint8 [N, nb, 32] in 0..31: the low nibbles as Q4_0's,
    the fifth bits in qh, a little-endian uint32 whose bit j belongs to element j."""
    n, nb, _ = qs.shape
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((qh.unsqueeze(-1) >> shifts) & 1).reshape(n, nb, 32)
    return torch.cat([qs & 15, qs >> 4], dim=-1) | (high << 4)


def _q5_0(blocks: torch.Tensor) -> BlockQuantWeight:
    n, nb, _ = blocks.shape
    q = _q5_values(blocks[..., 2:6], blocks[..., 6:]).view(torch.int8) - 16
    return BlockQuantWeight(8, q.reshape(n, nb * 32), _f16(blocks[..., :2]), None, 32)


def _q5_1(blocks: torch.Tensor) -> BlockQuantWeight:
    n, nb, _ = blocks.shape
    d, m = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    q = _q5_values(blocks[..., 4:8], blocks[..., 8:]).view(torch.int8)
    return BlockQuantWeight(8, q.reshape(n, nb * 32), d, m, 32)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 sub-block scales and mins, float32 [N, nb * 8]: d * sc, -dmin * m.

    12 bytes hold eight 6-bit sc and m: bytes 0-3 the low 6 bits of sc 0-3 (top 2 bits:
    sc 4-7's high bits), bytes 4-7 the same for m, bytes 8-11 sc 4-7 (low nibble) and m 4-7
    (high nibble)."""
    n, nb, _ = blocks.shape
    d, dmin = _f16(blocks[..., :2]).float(), _f16(blocks[..., 2:4]).float()
    packed = blocks[..., 4:16].reshape(n, nb, 3, 4)
    lo_sc, lo_m, hi = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    sc = torch.cat([lo_sc & 63, (hi & 15) | ((lo_sc >> 2) & 48)], dim=-1)
    m = torch.cat([lo_m & 63, (hi >> 4) | ((lo_m >> 2) & 48)], dim=-1)
    scales = d.unsqueeze(-1) * sc.float()
    mins = -(dmin.unsqueeze(-1) * m.float())
    return scales.reshape(n, nb * 8), mins.reshape(n, nb * 8)


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 bytes per super-block -> uint8 [N, nb, 256] in 0..15: each 32 bytes
    hold two sub-blocks of 32 (the first in the low nibbles, the second in the high)."""
    n, nb, _ = qs.shape
    chunks = qs.reshape(n, nb, 4, 1, 32)
    return torch.cat([chunks & 15, chunks >> 4], dim=3).reshape(n, nb, QK_K)


def _q4_k(blocks: torch.Tensor) -> BlockQuantWeight:
    n, nb, _ = blocks.shape
    scales, mins = _k_scales(blocks)
    q = _k_low_nibbles(blocks[..., 16:]).reshape(n, nb * QK_K)
    return BlockQuantWeight(4, pack_int4(q), scales, mins, 32)


def _q5_k(blocks: torch.Tensor) -> BlockQuantWeight:
    n, nb, _ = blocks.shape
    scales, mins = _k_scales(blocks)
    # qh: 32 bytes; bit j of byte i is the fifth bit of element i of sub-block j.
    qh = blocks[..., 16:48].reshape(n, nb, 1, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
    high = ((qh >> shifts) & 1).reshape(n, nb, QK_K)
    q = _k_low_nibbles(blocks[..., 48:]) | (high << 4)
    return BlockQuantWeight(8, q.view(torch.int8).reshape(n, nb * QK_K), scales, mins, 32)


def _q6_k(blocks: torch.Tensor) -> BlockQuantWeight:
    """ql[128], qh[64], int8 scales[16], d: two halves of 128 elements, each from 64 ql
    bytes (low nibbles: elements 0-63, high: 64-127) and 32 qh bytes (2 bits per element,
    the 4 pairs of a byte for elements i, i + 32, i + 64, i + 96)."""
    n, nb, _ = blocks.shape
    ql = blocks[..., :128].reshape(n, nb, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(n, nb, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).view(torch.int8) - 32
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
    scales = _f16(blocks[..., 208:]).float().unsqueeze(-1) * sc
    return BlockQuantWeight(8, q.reshape(n, nb * QK_K), scales.reshape(n, nb * 16), None, 16)


_CONVERSIONS: dict[str, Callable[[torch.Tensor], BlockQuantWeight]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
