"""compressed-tensors checkpoints (quant_method "compressed-tensors") in the
"pack-quantized" format: weight-only int4/int8 (W4A16, W8A16), stored output-major:

    weight_packed     int32 [N, K * bits / 32]  signed codes + 2^(bits-1), code i of a
                                                 word at bits i * bits
    weight_scale      [N, K / g] (group strategy) or [N, 1] (channel)
    weight_zero_point int32 [N * bits / 32, K / g] (asymmetric only), signed, packed
                                                 along the output features the same way
    weight_shape      int [2]: (N, K)
    weight_g_idx      int32 [K] (actorder "group" only): each input feature's group

w[n, k] = weight_scale[n, g_idx[k]] * (code[n, k] - zero_point[n, g_idx[k]]), g_idx[k] =
k // g without act-order. With it the groups are in no particular order: as GPTQ's
desc_act (gptq.py), the scales and zero points are replicated on every rank and the
repack gathers x; experts as int_moe.py says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
from models.layers.linear import LinearBase
from models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from models.quantization.int_checkpoint import (
    IntCheckpointLinearMethod,
    IntWeight,
    act_order_group_ids,
    add_param,
    check_geometry,
    checkpoint_names,
    same_for_all,
    scale_dtype_for,
    unpack_int32,
)
from models.quantization.int_moe import IntCheckpointMoEMethod


@dataclass(frozen=True)
class WeightScheme:
    bits: int
    group_size: int | None  # None: one scale per output channel
    symmetric: bool
    act_order: bool = False  # actorder "group": weight_g_idx names each feature's group

    @property
    def tensor_names(self) -> tuple[str, ...]:
        zero = () if self.symmetric else ("weight_zero_point",)
        g_idx = ("weight_g_idx",) if self.act_order else ()
        return ("weight_packed", "weight_scale", *zero, *g_idx, "weight_shape")

    def int_weight(self, tensors: dict[str, torch.Tensor]) -> IntWeight:
        """The logical weight of one projection's tensors. Codes and zero points are both
        stored + 2^(bits-1): as stored they are the unsigned codes and their zero points."""
        q = unpack_int32(tensors["weight_packed"], self.bits, dim=1)
        if "weight_shape" in tensors and tuple(tensors["weight_shape"].tolist()) != tuple(q.shape):
            shape = tuple(tensors["weight_shape"].tolist())
            raise ValueError(f"checkpoint weight_shape {shape} != the codes' {tuple(q.shape)}")
        zeros = None
        if not self.symmetric:
            zeros = unpack_int32(tensors["weight_zero_point"], self.bits, dim=0).to(torch.int16)
        return IntWeight(self.bits, q, tensors["weight_scale"].float(), zeros)


class CompressedTensorsWNA16(IntCheckpointLinearMethod):
    def __init__(self, scheme: WeightScheme) -> None:
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        bits, k, n = self.scheme.bits, input_size_per_partition, sum(output_partition_sizes)
        per_word, g = 32 // bits, self.scheme.group_size or input_size
        sharded = g != input_size and not self.scheme.act_order
        check_geometry(layer, k, output_partition_sizes, g, sharded_groups=sharded)
        groups = (1, g) if sharded else None
        num_groups = k // g if sharded else -(-input_size // g)
        add_param(layer, "weight_packed", (n, k // per_word), torch.int32, (0, 1), (1, per_word))
        add_param(layer, "weight_scale", (n, num_groups), torch.float32, (0, 1), groups)
        if not self.scheme.symmetric:
            shape = (n // per_word, num_groups)
            add_param(layer, "weight_zero_point", shape, torch.int32, (0, per_word), groups)
        shards = len(output_partition_sizes)
        if self.scheme.act_order:
            shape = (shards, k)
            add_param(layer, "weight_g_idx", shape, torch.int32, None, (0, 1), per_shard=True)
        add_param(layer, "weight_shape", (shards, 2), torch.int64, None, None, per_shard=True)
        self.scale_dtype = scale_dtype_for(params_dtype)
        self.expected_shapes = _projection_shapes(layer, input_size)

    def checkpoint_param_names(self) -> tuple[str, ...]:
        return self.scheme.tensor_names

    def int_weight(self, layer: nn.Module) -> IntWeight:
        shapes = [tuple(s) for s in layer.weight_shape.tolist()]
        if shapes != self.expected_shapes:
            raise ValueError(
                f"{layer.prefix}: checkpoint weight_shape {shapes} != {self.expected_shapes}"
            )
        names = self.scheme.tensor_names[:-1]  # weight_shape: checked above, per shard
        weight = self.scheme.int_weight({name: getattr(layer, name).data for name in names})
        if self.scheme.act_order:
            g_idx = layer.weight_g_idx.data
            weight.group_ids = act_order_group_ids(layer, g_idx, weight.scales.shape[1])
        return weight


def _projection_shapes(layer: nn.Module, input_size: int) -> list[tuple[int, int]]:
    """The checkpoint's (N, K) of each projection fused in `layer`."""
    try:
        rows = [rows for _, rows in layer.checkpoint_projections()]
    except NotImplementedError:
        rows = [layer.output_size]
    return [(n, input_size) for n in rows]


def _scheme(group: dict[str, Any]) -> WeightScheme:
    weights = group.get("weights") or {}
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    strategy, actorder = weights.get("strategy"), weights.get("actorder")
    if group.get("input_activations") or kind != "int" or bits not in (4, 8):
        raise ValueError(
            "compressed-tensors: only weight-only int4/int8 (W4A16, W8A16) is supported, "
            f"got weights {weights} with input_activations {group.get('input_activations')}"
        )
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported")
    if actorder not in (None, "group", "weight", "static", "dynamic"):
        raise ValueError(f"compressed-tensors: actorder {actorder!r} is not supported")
    act_order = actorder in ("group", "dynamic")  # "dynamic" and "static" are aliases
    if act_order and strategy != "group":
        raise ValueError(f"compressed-tensors: actorder {actorder!r} needs the group strategy")
    group_size = int(weights["group_size"]) if strategy == "group" else None
    return WeightScheme(bits, group_size, bool(weights.get("symmetric", True)), act_order)


def _matches(name: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in ("Linear", name) or name.endswith(f".{pattern}"):
            return True
    return False


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], WeightScheme]], ignore: list[str]) -> None:
        self.groups = groups
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = config.get("format")
        groups = []
        for name, group in (config.get("config_groups") or {}).items():
            group_format = group.get("format") or fmt
            if group_format != "pack-quantized":
                raise ValueError(
                    f"compressed-tensors: format {group_format!r} of {name} is not supported "
                    "(supported: pack-quantized)"
                )
            groups.append((list(group.get("targets") or []), _scheme(group)))
        if not groups:
            raise ValueError("compressed-tensors: quantization_config has no config_groups")
        return cls(groups, list(config.get("ignore") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, FusedMoE):  # its experts' projections, as the checkpoint names them
            schemes = [self._scheme_of(f"{prefix}.0.{p}_proj") for p in ("gate", "up", "down")]
            scheme = same_for_all(prefix, schemes)
            if scheme is None:
                return UnquantizedFusedMoEMethod()
            g_idx = "weight_g_idx" if scheme.act_order else None
            return IntCheckpointMoEMethod(scheme.tensor_names, scheme.int_weight, g_idx=g_idx)
        if not isinstance(layer, LinearBase):
            return None
        scheme = same_for_all(prefix, [self._scheme_of(n) for n in checkpoint_names(prefix)])
        return None if scheme is None else CompressedTensorsWNA16(scheme)

    def _scheme_of(self, name: str) -> WeightScheme | None:
        if _matches(name, self.ignore):
            return None
        for targets, scheme in self.groups:
            if _matches(name, targets):
                return scheme
        return None
