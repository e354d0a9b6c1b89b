"""AWQ and GPTQ checkpoints' experts (`IntCheckpointMoEMethod`): each expert projection's
packed tensors (qweight, qzeros, scales) are unpacked whole to their logical weight
(int_checkpoint.IntWeight, by the format's own unpacking), cut there to this rank's part
(gate and up: their output rows; down: its input features and their groups), repacked as a
BlockQuantWeight and run as any block-quantized experts (quant_moe.BlockQuantMoEMethod).
Cutting the logical weight rather than the packed words keeps every format's packing
order out of the slicing. act-order (GPTQ desc_act) experts are refused: the experts
kernel has no per-expert input gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.quantization.block_quant import BlockQuantWeight
from models.quantization.int_checkpoint import IntWeight, scale_dtype_for, to_block_quant
from models.quantization.quant_moe import BlockQuantMoEMethod, expert_name


class IntCheckpointMoEMethod(BlockQuantMoEMethod):
    """`names`: the tensors each projection needs; `int_weight` turns them into the logical
    weight; `ignored`: tensors the format may store that carry nothing here."""

    def __init__(
        self,
        names: tuple[str, ...],
        int_weight: Callable[[dict[str, torch.Tensor]], IntWeight],
        ignored: tuple[str, ...] = (),
    ) -> None:
        self.names, self.int_weight, self.ignored = names, int_weight, ignored

    def create_weights(self, layer: nn.Module) -> None:
        super().create_weights(layer)
        self.scale_dtype = scale_dtype_for(torch.get_default_dtype())

    def to_part(self, layer: nn.Module, projection: str, loaded: object) -> None:
        raise ValueError(
            f"{layer.prefix}: expert {projection} is stored unquantized in a "
            f"{type(self).__name__} checkpoint"
        )

    def load_packed(
        self, layer: nn.Module, expert: int, projection: str, kind: str, tensor: torch.Tensor
    ) -> None:
        if kind in self.names:
            self.parts[projection].setdefault(expert, {})[kind] = tensor
        elif kind not in self.ignored:
            super().load_packed(layer, expert, projection, kind, tensor)

    def expert_part(self, layer: nn.Module, projection: str, expert: int) -> BlockQuantWeight:
        tensors = self.parts[projection].get(expert, {})
        name = expert_name(layer, projection, expert)
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise ValueError(f"{name}: the checkpoint has no {', '.join(missing)}")
        weight = _this_rank(layer, projection, self.int_weight(tensors), name)
        return to_block_quant(weight, self.scale_dtype)[0]


def _this_rank(layer: nn.Module, projection: str, w: IntWeight, name: str) -> IntWeight:
    """Gate and up: the rank's output rows; down: its input features with their groups."""
    start, i = layer.intermediate_start, layer.intermediate_size
    if projection != "down":
        rows = slice(start, start + i)
        return IntWeight(w.bits, w.q[rows], w.scales[rows], _cut(w.zeros, rows))
    if w.scales.shape[1] == 1:  # one scale per output channel: it holds for any cut
        q = w.q[:, start : start + i].contiguous()
        return IntWeight(w.bits, q, w.scales, w.zeros)
    group = w.q.shape[1] // w.scales.shape[1]
    if i % group or i % 32:
        raise ValueError(
            f"{name}: {i} input features per rank do not hold whole groups of {group} "
            "(and runs of 32)"
        )
    groups = slice(start // group, (start + i) // group)
    q = w.q[:, start : start + i].contiguous()
    return IntWeight(w.bits, q, w.scales[:, groups].contiguous(), _cut(w.zeros, groups, 1))


def _cut(t: torch.Tensor | None, part: slice, dim: int = 0) -> torch.Tensor | None:
    if t is None:
        return None
    return (t[part] if dim == 0 else t[:, part]).contiguous()
