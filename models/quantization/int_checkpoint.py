"""What the integer checkpoint formats (AWQ, GPTQ, compressed-tensors) share: unpacking
int32 words, the repack into a BlockQuantWeight, and the linear method that loads the
checkpoint's tensors as parameters and computes on the repacked weight.

Every format describes the same logical weight, with unsigned codes q in [0, 2^bits):

    w[n, k] = scales[n, group(k)] * (q[n, k] - zeros[n, group(k)])

which is a BlockQuantWeight with mins = -scales * zeros (8-bit codes shifted to int8).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelSet
from models.layers.utils import set_shard_axes, set_weight_attrs
from models.quantization.base_config import LinearMethodBase
from models.quantization.block_quant import PACK_RUN, BlockQuantWeight, pack_int4
from models.quantization.cpu_quant_linear import (
    PreparedQuantWeight,
    prepare_quant_weight,
    quant_linear,
)


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Unsigned `bits`-bit codes packed 32 // bits to an int32 along `dim` -> uint8 with
    that dim 32 // bits times longer. Element i of a word sits at bit order[i] * bits
    (default: i * bits, the GPTQ and compressed-tensors order)."""
    per_word = 32 // bits
    slots = torch.tensor(order) if order is not None else torch.arange(per_word)
    slots = slots.to(packed.device)
    words = packed.movedim(dim, -1).unsqueeze(-1)
    codes = (words >> (slots * bits).to(torch.int32)) & ((1 << bits) - 1)
    return codes.flatten(-2).to(torch.uint8).movedim(-1, dim)


@dataclass
class IntWeight:
    """One rank's logical weight: codes q uint8 [N, K], scales float32 [N, G], zeros
    [N, G] (None: symmetric, 2^(bits-1)), and group_ids [K] (None: k // (K // G))."""

    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_ids: torch.Tensor | None = None


def to_block_quant(
    w: IntWeight, scale_dtype: torch.dtype
) -> tuple[BlockQuantWeight, torch.Tensor | None]:
    """(the BlockQuantWeight, the input index) of `w`. The input index is None when the
    groups are contiguous runs in order; else the weight's input features are reordered so
    that each group is contiguous, and x must be gathered by it first (an index equal to K
    means a zero: groups whose size is no multiple of a block are padded with zeros)."""
    k = w.q.shape[1]
    zeros = w.zeros if w.zeros is not None else torch.full_like(w.scales, 1 << (w.bits - 1))
    if w.group_ids is None:
        block, index, block_groups = k // w.scales.shape[1], None, None
    else:
        block, index, block_groups = _contiguous_groups(w.group_ids.long())
    q, scales = w.q, w.scales
    if index is not None:
        q = F.pad(q, (0, 1)).index_select(1, index)
    if block_groups is not None:  # the groups present, block after block
        scales, zeros = w.scales[:, block_groups], zeros[:, block_groups]
    offset = 0 if w.bits == 4 else 128
    zeros = zeros.float() - offset
    qweight = pack_int4(q) if w.bits == 4 else (q.to(torch.int16) - offset).to(torch.int8)
    mins = (-scales * zeros).to(scale_dtype) if zeros.any() else None
    return BlockQuantWeight(w.bits, qweight, scales.to(scale_dtype), mins, block), index


def _contiguous_groups(group_ids: torch.Tensor) -> tuple[int, torch.Tensor | None, torch.Tensor]:
    """(block size, input index or None, group of each block) that lay out the features
    of `group_ids` group after group. When the groups' sizes share a block (a multiple of
    16) that is the block; else each group's run is padded to a multiple of PACK_RUN."""
    k = group_ids.numel()
    order = torch.argsort(group_ids, stable=True)
    groups, counts = torch.unique_consecutive(group_ids[order], return_counts=True)
    block = math.gcd(*counts.tolist())
    if block % 16 == 0 and k % PACK_RUN == 0:
        index = None if bool((order == torch.arange(k, device=order.device)).all()) else order
        return block, index, groups.repeat_interleave(counts // block)
    runs, block_groups, start = [], [], 0
    for group, count in zip(groups.tolist(), counts.tolist(), strict=True):
        padded = -(-count // PACK_RUN) * PACK_RUN
        runs += [order[start : start + count], order.new_full((padded - count,), k)]
        block_groups += [group] * (padded // PACK_RUN)
        start += count
    return PACK_RUN, torch.cat(runs), order.new_tensor(block_groups)


# Layers fused here -> the checkpoint projections they hold (what a checkpoint's lists of
# modules to skip or target name).
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_names(prefix: str) -> list[str]:
    """The checkpoint's names of the projections in the layer named `prefix`."""
    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{p}" if parent else p for p in FUSED_PROJECTIONS.get(leaf, (leaf,))]


def same_for_all(prefix: str, values: list) -> Any:
    """The one value a fused layer's projections share (else a clear error)."""
    if any(v != values[0] for v in values):
        raise ValueError(
            f"{prefix}: the projections fused here ({', '.join(checkpoint_names(prefix))}) "
            "are quantized differently in the checkpoint"
        )
    return values[0]


def scale_dtype_for(params_dtype: torch.dtype) -> torch.dtype:
    """Scales of a float32 model stay float32 (exact); others are kept as float16."""
    return torch.float32 if params_dtype == torch.float32 else torch.float16


def add_param(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: tuple[int, int] | None,
    inp: tuple[int, int] | None,
    per_shard: bool = False,
) -> None:
    """Register a checkpoint tensor of `layer`, sharded by the layer's weight_loader."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_shard_axes(param, out=out, inp=inp)
    set_weight_attrs(param, {"weight_loader": layer.weight_loader})
    if per_shard:
        param.per_shard = True
    layer.register_parameter(name, param)


def check_geometry(
    layer: nn.Module, in_part: int, out_parts: list[int], group: int, sharded_groups: bool
) -> None:
    """Clear errors, naming the layer, for shards the repacked weight cannot hold."""
    if in_part % PACK_RUN:
        raise ValueError(
            f"{layer.prefix}: {in_part} input features per tensor-parallel shard is not a "
            f"multiple of {PACK_RUN}"
        )
    if sharded_groups and in_part % group:
        raise ValueError(
            f"{layer.prefix}: group size {group} does not divide the {in_part} input "
            "features of this tensor-parallel shard"
        )
    if group % 16:
        raise ValueError(f"{layer.prefix}: group size {group} is not a multiple of 16")
    for size in out_parts:
        if size % 8:
            raise ValueError(
                f"{layer.prefix}: {size} output features per shard is not a multiple of 8"
            )


def checked_group_ids(g_idx: torch.Tensor, k: int, num_groups: int, name: str) -> torch.Tensor:
    """g_idx as int64, refused by name unless it gives each of k features a group."""
    g_idx = g_idx.long()
    if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= num_groups:
        raise ValueError(f"{name}.g_idx: expected {k} group indices in [0, {num_groups})")
    return g_idx


def act_order_group_ids(layer: nn.Module, g_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The one g_idx [K] of a layer's fused projections ([shards, K] as loaded): each input
    feature's group, groups in no particular order (act-order)."""
    if not bool((g_idx == g_idx[0]).all()):
        raise ValueError(f"{layer.prefix}: the fused projections have different g_idx")
    return checked_group_ids(g_idx[0], g_idx.shape[1], num_groups, layer.prefix)


class IntCheckpointLinearMethod(LinearMethodBase):
    """Loads a format's tensors, repacks them once (`int_weight`, then to_block_quant) and
    computes on the BlockQuantWeight. create_weights sets `scale_dtype`."""

    @abstractmethod
    def int_weight(self, layer: nn.Module) -> IntWeight:
        """The loaded parameters of `layer` as one logical weight (the format's part)."""

    @abstractmethod
    def checkpoint_param_names(self) -> tuple[str, ...]:
        """The parameters create_weights registers (dropped once repacked)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = self.int_weight(layer)
        quant_weight, input_index = to_block_quant(weight, self.scale_dtype)
        layer.input_index = input_index
        layer.pad_input = input_index is not None and bool((input_index == weight.q.shape[1]).any())
        for name in self.checkpoint_param_names():
            delattr(layer, name)
        layer.prepared_weight = PreparedQuantWeight(quant_weight, None)

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        layer.prepared_weight = prepare_quant_weight(layer.prepared_weight, kernels)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.input_index is not None:
            x = (F.pad(x, (0, 1)) if layer.pad_input else x).index_select(-1, layer.input_index)
        return quant_linear(x, layer.prepared_weight, bias)

    def decode_weight(self, layer: nn.Module) -> PreparedQuantWeight | None:
        return layer.prepared_weight if layer.input_index is None else None
