"""Writers of AWQ, GPTQ and compressed-tensors checkpoints for tests, from the formats'
specs: round-to-nearest quantization of a float checkpoint, packed as each format stores
it, with the dequantized weights the transformers oracle runs on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.quantization.reference import LINEARS

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the code each nibble of an AWQ word holds


@dataclass
class Quantized:
    """w ~ scales[:, g_idx] * (q - zeros[:, g_idx]): q [N, K] in [0, 2^bits), scales
    [N, G] (rounded to the checkpoint's dtype), zeros [N, G], g_idx [K]."""

    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        idx = self.g_idx.long()
        return (self.q.float() - self.zeros[:, idx].float()) * self.scales[:, idx].float()


def rtn(
    w: torch.Tensor,
    bits: int,
    g_idx: torch.Tensor,
    sym: bool,
    scale_dtype: torch.dtype = torch.float16,
) -> Quantized:
    """Round-to-nearest per group of input features (the groups g_idx names)."""
    n, groups = w.shape[0], int(g_idx.max()) + 1
    top = (1 << bits) - 1
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups, dtype=torch.int32)
    for j in range(groups):
        part = w[:, g_idx == j].float()
        lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
        if sym:
            scale = torch.maximum(-lo, hi) / ((top - 1) / 2)
            zero = torch.full((n,), (top + 1) // 2)
        else:
            scale = (hi - lo) / top
            zero = torch.round(-lo / scale).to(torch.int32)
        scales[:, j] = scale.to(scale_dtype).float()
        zeros[:, j] = zero
    idx = g_idx.long()
    q = torch.round(w.float() / scales[:, idx]) + zeros[:, idx]
    q = q.clamp(0, top).to(torch.int32)
    return Quantized(bits, q, scales.to(scale_dtype), zeros, g_idx.to(torch.int32))


def group_ids(k: int, group: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """g_idx of contiguous groups; with act-order `perm`, the i-th feature processed
    (perm[i]) is in group i // group."""
    ids = torch.arange(k) // group
    if perm is None:
        return ids
    out = torch.empty_like(ids)
    out[perm] = ids
    return out


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack unsigned codes 32 // bits to an int32 along `dim`; nibble/byte slot i of a
    word holds code order[i] of its run (default: code i)."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    c = codes.movedim(dim, -1).to(torch.int64)
    runs = c.reshape(*c.shape[:-1], c.shape[-1] // per_word, per_word)
    word = torch.zeros(runs.shape[:-1], dtype=torch.int64)
    for slot, code in enumerate(order):
        word |= runs[..., code] << (slot * bits)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).movedim(-1, dim)


def awq_tensors(qw: Quantized) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack_int32(qw.q.t(), 4, 1, AWQ_PACK_ORDER),
        "qzeros": pack_int32(qw.zeros.t(), 4, 1, AWQ_PACK_ORDER),
        "scales": qw.scales.t().contiguous(),
    }


def gptq_tensors(qw: Quantized) -> dict[str, torch.Tensor]:
    """The "gptq" checkpoint format: zero points stored minus one."""
    assert qw.zeros.min() >= 1, "the gptq format cannot store a zero point of 0"
    return {
        "qweight": pack_int32(qw.q.t(), qw.bits, 0),
        "qzeros": pack_int32(qw.zeros.t() - 1, qw.bits, 1),
        "scales": qw.scales.t().contiguous(),
        "g_idx": qw.g_idx,
    }


def compressed_tensors(
    qw: Quantized, sym: bool, act_order: bool = False
) -> dict[str, torch.Tensor]:
    """pack-quantized: signed codes and zero points, stored + 2^(bits-1); actorder "group"
    adds each input feature's group (weight_g_idx)."""
    out = {
        "weight_packed": pack_int32(qw.q, qw.bits, 1),
        "weight_scale": qw.scales,
        "weight_shape": torch.tensor(list(qw.q.shape)),
    }
    if not sym:
        out["weight_zero_point"] = pack_int32(qw.zeros, qw.bits, 0)
    if act_order:
        out["weight_g_idx"] = qw.g_idx
    return out


Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_quantized(src: str, dst: Path, quantize: Quantizer, config: dict) -> dict:
    """Copy checkpoint `src` to `dst` with each linear layer `name`'s weight replaced by
    the tensors quantize(name, weight) gives (name.<tensor>), and `config` as its
    quantization_config. Returns {name: the dequantized weight}."""
    shutil.copytree(src, dst)
    tensors, dequantized = {}, {}
    for key, value in load_file(str(dst / "model.safetensors")).items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
            packed, dequantized[module] = quantize(module, value)
            tensors.update({f"{module}.{name}": t.contiguous() for name, t in packed.items()})
        else:
            tensors[key] = value
    save_file(tensors, str(dst / "model.safetensors"))
    hf_config = json.loads((dst / "config.json").read_text())
    hf_config["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(hf_config))
    return dequantized
