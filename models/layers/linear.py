"""Tensor-parallel linear layers (Megatron style, as in vLLM).

Column parallel: the output features are split across ranks (weight rows); no
communication in forward. Row parallel: the input features are split (weight columns);
partial products are all-reduced, then the bias is added once.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)` that copies
this rank's shard of a full checkpoint tensor (or lazy safetensors slice).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.layers.cpu_linear import PackedWeightMixin, linear
from models.layers.utils import (
    ShardedModule,
    copy_weight,
    default_weight_loader,
    divide,
    narrow_weight,
    register_linear_params,
    weight_shape,
)
from models.parallel_state import get_tp_size, tp_all_reduce


class ColumnParallelLinear(PackedWeightMixin, ShardedModule):
    """y = x A^T + b with A's rows (output features) split across ranks: the output is
    this rank's slice [.., output_size / tp]."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, prefix: str = ""
    ) -> None:
        super().__init__(prefix)
        self.output_size = output_size
        register_linear_params(self, self._partition_size(), input_size, bias)

    def _partition_size(self) -> int:
        return divide(self.output_size, self.tp_size, f"{self.prefix} output size")

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        self.load_rank_slice(param, loaded_weight, shard_id, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one weight
    (gate_proj and up_proj -> gate_up_proj). Each rank holds [shard_0; shard_1; ...]:
    its slice of every projection, in order. shard_id is the projection's index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        prefix: str = "",
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, prefix)

    def _partition_size(self) -> int:
        return sum(divide(s, self.tp_size, f"{self.prefix} output size") for s in self.output_sizes)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused weight: split it per projection.
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, narrow_weight(loaded_weight, 0, offset, size), i)
                offset += size
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: bad shard_id {shard_id!r}")
        shard_size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if weight_shape(loaded_weight)[0] != self.output_sizes[shard_id]:
            raise ValueError(
                f"{self.prefix}: shard {shard_id} has {weight_shape(loaded_weight)[0]} rows, "
                f"expected {self.output_sizes[shard_id]}"
            )
        copy_weight(
            param.data.narrow(0, offset, shard_size),
            narrow_weight(loaded_weight, 0, self.tp_rank * shard_size, shard_size),
            f"{self.prefix}[{shard_id}]",
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, heads split across ranks.

    When tp > total_num_kv_heads, each rank holds one kv head and each kv head is
    replicated on tp / total_num_kv_heads consecutive ranks (as vLLM does).
    Per-rank layout: [q (num_heads*head_size); k (num_kv_heads*head_size); v (same)].
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        prefix: str = "",
    ) -> None:
        tp_size = get_tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, f"{prefix} num_attention_heads")
        self.num_kv_heads, self.num_kv_head_replicas = kv_heads_per_rank(
            total_num_kv_heads, tp_size
        )
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        output_size = (total_num_heads + 2 * self.num_kv_heads * tp_size) * head_size
        super().__init__(hidden_size, output_size, bias, prefix)

    def _partition_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused [q; k; v] weight.
            q_rows = self.total_num_heads * self.head_size
            kv_rows = self.total_num_kv_heads * self.head_size
            self.weight_loader(param, narrow_weight(loaded_weight, 0, 0, q_rows), "q")
            self.weight_loader(param, narrow_weight(loaded_weight, 0, q_rows, kv_rows), "k")
            self.weight_loader(
                param, narrow_weight(loaded_weight, 0, q_rows + kv_rows, kv_rows), "v"
            )
            return
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
            total = self.total_num_heads * self.head_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
            start = (self.tp_rank // self.num_kv_head_replicas) * self.kv_size
            total = self.total_num_kv_heads * self.head_size
        else:
            raise ValueError(f"{self.prefix}: bad shard_id {shard_id!r}")
        if weight_shape(loaded_weight)[0] != total:
            raise ValueError(
                f"{self.prefix}: {shard_id} has {weight_shape(loaded_weight)[0]} rows, "
                f"expected {total}"
            )
        copy_weight(
            param.data.narrow(0, offset, size),
            narrow_weight(loaded_weight, 0, start, size),
            f"{self.prefix}.{shard_id}",
        )


class RowParallelLinear(PackedWeightMixin, ShardedModule):
    """y = x A^T + b with A's columns (input features) split across ranks: the input is
    this rank's slice [.., input_size / tp]. Partial outputs are all-reduced and the
    bias is added once, after the reduction."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, prefix: str = ""
    ) -> None:
        super().__init__(prefix)
        input_size_per_partition = divide(input_size, self.tp_size, f"{prefix} input size")
        register_linear_params(
            self, output_size, input_size_per_partition, bias, default_weight_loader
        )

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        self.load_rank_slice(param, loaded_weight, shard_id, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        out = tp_all_reduce(linear(x, self.weight, None, self.packed_weight))
        return out if self.bias is None else out + self.bias


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(kv heads held by each rank, how many ranks hold each kv head)."""
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise ValueError(
                f"tensor parallel size {tp_size} is not a multiple of num_key_value_heads "
                f"{total_num_kv_heads}"
            )
        return 1, tp_size // total_num_kv_heads
    return divide(total_num_kv_heads, tp_size, "num_key_value_heads"), 1
