"""AWQ checkpoints (quant_method "awq", the GEMM version): 4-bit codes with a zero
point per group of input features, stored input-major:

    qweight int32 [K, N / 8]   8 codes of consecutive output features per word, code j
                               at bits 4 * AWQ_ORDER[j]
    qzeros  int32 [K / g, N / 8] the zero points, packed the same way
    scales  [K / g, N]          w[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
from models.layers.linear import LinearBase
from models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from models.quantization.int_checkpoint import (
    IntCheckpointLinearMethod,
    IntWeight,
    add_param,
    check_geometry,
    checkpoint_names,
    same_for_all,
    scale_dtype_for,
    unpack_int32,
)
from models.quantization.int_moe import IntCheckpointMoEMethod

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble of each of a word's 8 codes


class AWQLinearMethod(IntCheckpointLinearMethod):
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        g = self.group_size if self.group_size != -1 else input_size
        check_geometry(layer, k, output_partition_sizes, g, sharded_groups=g != input_size)
        groups = (0, g) if g != input_size else None
        num_groups = k // g if groups else 1
        add_param(layer, "qweight", (k, n // 8), torch.int32, out=(1, 8), inp=(0, 1))
        add_param(layer, "qzeros", (num_groups, n // 8), torch.int32, out=(1, 8), inp=groups)
        add_param(layer, "scales", (num_groups, n), torch.float32, out=(1, 1), inp=groups)
        self.scale_dtype = scale_dtype_for(params_dtype)

    def checkpoint_param_names(self) -> tuple[str, ...]:
        return AWQ_TENSORS

    def int_weight(self, layer: nn.Module) -> IntWeight:
        return awq_int_weight({name: getattr(layer, name).data for name in AWQ_TENSORS})


AWQ_TENSORS = ("qweight", "qzeros", "scales")


def awq_int_weight(tensors: dict[str, torch.Tensor]) -> IntWeight:
    """The logical weight of one projection's qweight, qzeros and scales."""
    q = unpack_int32(tensors["qweight"], 4, dim=1, order=AWQ_ORDER).t()
    zeros = unpack_int32(tensors["qzeros"], 4, dim=1, order=AWQ_ORDER).t()
    return IntWeight(4, q.contiguous(), tensors["scales"].float().t().contiguous(), zeros)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit"))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"awq: only 4-bit checkpoints are supported, got bits={bits}")
        if version != "gemm":
            raise ValueError(f"awq: only the GEMM version is supported, got {version!r}")
        if not config.get("zero_point", True):
            raise ValueError("awq: checkpoints without zero points are not supported")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        return cls(group_size, list(config.get("modules_to_not_convert") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, FusedMoE):
            projections = [f"{prefix}.0.{p}_proj" for p in ("gate", "up", "down")]
            skipped = [any(m in name for m in self.modules_to_not_convert) for name in projections]
            if same_for_all(prefix, skipped):
                return UnquantizedFusedMoEMethod()
            return IntCheckpointMoEMethod(AWQ_TENSORS, awq_int_weight)
        if not isinstance(layer, LinearBase):
            return None
        skipped = [
            any(module in name for module in self.modules_to_not_convert)
            for name in checkpoint_names(prefix)
        ]
        return None if same_for_all(prefix, skipped) else AWQLinearMethod(self.group_size)
