"""GPTQ checkpoints (quant_method "gptq"), 4 or 8 bits, stored input-major:

    qweight int32 [K * bits / 32, N]  codes of consecutive input features, code i of a
                                      word at bits i * bits
    qzeros  int32 [K / g, N * bits / 32] zero points packed along the output features
    scales  [K / g, N]
    g_idx   int32 [K]                 the group of each input feature

w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]). The "gptq" checkpoint
format (what AutoGPTQ and transformers/optimum write) stores zero - 1; "gptq_v2" stores
the zero itself. With desc_act (act-order) g_idx is a permutation of the groups: the
repack reorders the input features so that each group is contiguous and gathers x the
same way; a row-parallel shard then holds uneven parts of groups, so the scales and
zeros are replicated on every rank (as vLLM does) and indexed by the global g_idx.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.layers.fused_moe import FusedMoE
from models.layers.linear import LinearBase
from models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from models.quantization.int_checkpoint import (
    IntCheckpointLinearMethod,
    IntWeight,
    act_order_group_ids,
    add_param,
    check_geometry,
    scale_dtype_for,
    unpack_int32,
)
from models.quantization.int_moe import IntCheckpointMoEMethod

ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> stored zero + offset
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQLinearMethod(IntCheckpointLinearMethod):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        bits, k, n = self.config.bits, input_size_per_partition, sum(output_partition_sizes)
        g = self.config.group_size if self.config.group_size != -1 else input_size
        per_word = 32 // bits
        replicated = self.config.desc_act or g == input_size
        check_geometry(layer, k, output_partition_sizes, g, sharded_groups=not replicated)
        groups = None if replicated else (0, g)
        num_groups = -(-input_size // g) if replicated else k // g
        add_param(layer, "qweight", (k // per_word, n), torch.int32, out=(1, 1), inp=(0, per_word))
        add_param(
            layer, "qzeros", (num_groups, n // per_word), torch.int32, out=(1, per_word), inp=groups
        )
        add_param(layer, "scales", (num_groups, n), torch.float32, out=(1, 1), inp=groups)
        shards = len(output_partition_sizes)
        add_param(layer, "g_idx", (shards, k), torch.int32, out=None, inp=(0, 1), per_shard=True)
        self.scale_dtype = scale_dtype_for(params_dtype)

    def checkpoint_param_names(self) -> tuple[str, ...]:
        return GPTQ_TENSORS

    def int_weight(self, layer: nn.Module) -> IntWeight:
        tensors = {name: getattr(layer, name).data for name in GPTQ_TENSORS}
        weight = self.config.int_weight(tensors)
        if self.config.desc_act:
            weight.group_ids = act_order_group_ids(layer, layer.g_idx.data, weight.scales.shape[1])
        return weight


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, checkpoint_format: str) -> None:
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = config.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"gptq: only 4- and 8-bit checkpoints are supported, got bits={bits}")
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ZERO_OFFSET:
            raise ValueError(
                f"gptq: checkpoint format {fmt!r} is not supported (supported: "
                f"{', '.join(ZERO_OFFSET)})"
            )
        if config.get("lm_head"):
            raise ValueError("gptq: a quantized lm_head is not supported")
        desc_act = bool(config.get("desc_act", False))
        return cls(bits, int(config.get("group_size", 128)), desc_act, fmt)

    def int_weight(self, tensors: dict[str, torch.Tensor]) -> IntWeight:
        """The logical weight of one projection's qweight, qzeros and scales, its input
        features in checkpoint order (g_idx is left to the caller)."""
        bits = self.bits
        q = unpack_int32(tensors["qweight"], bits, dim=0).t().contiguous()
        zeros = unpack_int32(tensors["qzeros"], bits, dim=1).to(torch.int16)
        zeros = (zeros + ZERO_OFFSET[self.checkpoint_format]).t().contiguous()
        return IntWeight(bits, q, tensors["scales"].float().t().contiguous(), zeros)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, FusedMoE):
            if self.desc_act:
                return IntCheckpointMoEMethod(GPTQ_TENSORS, self.int_weight, g_idx="g_idx")
            # g_idx (when stored) names contiguous groups without act-order: not needed.
            return IntCheckpointMoEMethod(GPTQ_TENSORS[:3], self.int_weight, ("g_idx",))
        return GPTQLinearMethod(self) if isinstance(layer, LinearBase) else None
