"""AWQ, GPTQ and compressed-tensors checkpoints' experts (`IntCheckpointMoEMethod`): each
expert projection's packed tensors (qweight, qzeros, scales, ...) are unpacked whole to
their logical weight (int_checkpoint.IntWeight, by the format's own unpacking), cut there
to this rank's part (gate and up: their output rows; down: its input features and their
groups), repacked as a BlockQuantWeight and run as any block-quantized experts
(quant_moe.BlockQuantMoEMethod). Cutting the logical weight rather than the packed words
keeps every format's packing order out of the slicing.

Act-order (GPTQ desc_act, compressed-tensors actorder "group"): g_idx puts each input
feature in a group in no particular order. Down's input features are the expert's
intermediate features, which any split across ranks sums to the same output: a rank
takes down's features in group order (`_rank_features`: runs of whole groups, or of parts
of groups with their group's scales) and gate and up take the same rows, so nothing moves
at run time. Gate and up read the hidden state every expert shares: their features are
reordered group after group and each expert gathers its rows of x by that index
(quant_moe.GatheredWeight).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.quantization.block_quant import BlockQuantWeight
from models.quantization.int_checkpoint import (
    IntWeight,
    checked_group_ids,
    scale_dtype_for,
    to_block_quant,
)
from models.quantization.quant_moe import BlockQuantMoEMethod, GatheredWeight, expert_name


class IntCheckpointMoEMethod(BlockQuantMoEMethod):
    """`names`: the tensors each projection needs; `int_weight` turns them into the logical
    weight; `ignored`: tensors the format may store that carry nothing here; `g_idx`: the
    one of `names` that gives each input feature's group, where the groups are in no
    particular order (act-order; None: contiguous groups)."""

    def __init__(
        self,
        names: tuple[str, ...],
        int_weight: Callable[[dict[str, torch.Tensor]], IntWeight],
        ignored: tuple[str, ...] = (),
        g_idx: str | None = None,
    ) -> None:
        self.names, self.int_weight, self.ignored, self.g_idx = names, int_weight, ignored, g_idx

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

    def expert_part(
        self, layer: nn.Module, projection: str, expert: int
    ) -> BlockQuantWeight | GatheredWeight:
        name = expert_name(layer, projection, expert)
        w = self.int_weight(self._tensors(layer, projection, expert))
        if self.g_idx is None:
            return to_block_quant(_this_rank(layer, projection, w, name), self.scale_dtype)[0]
        features = self._rank_features(layer, expert)
        g_idx = self.parts[projection][expert][self.g_idx]
        g_idx = checked_group_ids(g_idx, w.q.shape[1], w.scales.shape[1], name)
        if projection == "down":
            w = IntWeight(w.bits, w.q[:, features], w.scales, w.zeros, g_idx[features])
        else:
            zeros = None if w.zeros is None else w.zeros[features]
            w = IntWeight(w.bits, w.q[features], w.scales[features], zeros, g_idx)
        weight, index = to_block_quant(w, self.scale_dtype)
        if index is None:
            return weight
        if projection == "down":
            raise ValueError(
                f"{name}: {layer.intermediate_size} input features per rank split its "
                "act-order groups into runs that are no multiple of 16"
            )
        if bool((index == w.q.shape[1]).any()):
            raise ValueError(f"{name}: act-order groups of unequal sizes are not supported")
        return GatheredWeight(weight, index)

    def _tensors(self, layer: nn.Module, projection: str, expert: int) -> dict[str, torch.Tensor]:
        tensors = self.parts[projection].get(expert, {})
        missing = [n for n in self.names if n not in tensors]
        if missing:
            name = expert_name(layer, projection, expert)
            raise ValueError(f"{name}: the checkpoint has no {', '.join(missing)}")
        return tensors

    def _rank_features(self, layer: nn.Module, expert: int) -> torch.Tensor:
        """This rank's intermediate features of `expert`: its share of down's input
        features taken in group order."""
        g_idx = self._tensors(layer, "down", expert)[self.g_idx]
        order = torch.argsort(g_idx.long(), stable=True)
        return order[layer.intermediate_start : layer.intermediate_start + layer.intermediate_size]


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
