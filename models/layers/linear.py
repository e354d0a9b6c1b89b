"""Tensor-parallel linear layers (Megatron style, as in vLLM).

Column parallel: the output features are split across ranks (weight rows); no
communication in forward. Row parallel: the input features are split (weight columns);
partial products are all-reduced, then the bias is added once.

A layer's quantization method (models.quantization) creates its parameters and computes
with them; the layer knows the geometry: which rows of which checkpoint projection this
rank holds (`output_shard`) and which input features (`input_shard`). Its
`weight_loader(param, loaded_weight, shard_id=None)` slices a full checkpoint tensor (or
lazy safetensors slice) along the parameter's `out_axis` / `in_axis`, so a packed or
grouped tensor (8 int4 per int32, one scale per group) is sharded by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import KernelSet
from models.layers.cpu_linear import PackedWeight, linear, pack_weight
from models.layers.utils import (
    ShardedModule,
    copy_weight,
    divide,
    full_weight,
    narrow_weight,
    new_parameter,
    set_shard_axes,
    set_weight_attrs,
    weight_shape,
)
from models.parallel_state import get_tp_size, tp_all_reduce
from models.quantization.base_config import LinearMethodBase, current_quant_config


@dataclass(frozen=True)
class OutputShard:
    """Where one checkpoint projection's rows go on this rank: rows [start, start + size)
    of the checkpoint tensor (which has `total`) fill rows [offset, offset + size) of the
    layer's output; `index` is the projection's position in the layer."""

    index: int
    offset: int
    size: int
    start: int
    total: int


@dataclass(frozen=True)
class InputShard:
    """This rank's input features [start, start + size) of `total`."""

    start: int
    size: int
    total: int


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense weight [out, in] in the model's dtype (or bf16: loader.dense_weight_dtype);
    on CPU small batches run through the packed AMX kernel where the kernel set has it,
    through the dense kernel (float32 math) where the CPU has no bf16 instructions
    (models.layers.cpu_linear)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        weight = new_parameter(sum(output_partition_sizes), input_size_per_partition)
        set_shard_axes(weight, out=(0, 1), inp=(1, 1))
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader})
        layer.weight = weight
        layer.packed_weight = None

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        layer.packed_weight = pack_weight(layer.weight, kernels)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.packed_weight)

    def decode_weight(self, layer: nn.Module) -> torch.Tensor | PackedWeight | None:
        return layer.weight if layer.packed_weight is None else layer.packed_weight


class LinearBase(ShardedModule):
    """y = x W^T + b, W held as its quantization method says."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        prefix: str,
    ) -> None:
        super().__init__(prefix)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        config = current_quant_config()
        method = config.get_quant_method(self, prefix) if config is not None else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            torch.get_default_dtype(),
        )
        if bias:
            self.bias = new_parameter(sum(output_partition_sizes))
            set_shard_axes(self.bias, out=(0, 1) if self.output_sharded else None)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    output_sharded = True

    def output_shard(self, shard_id: Any) -> OutputShard | None:
        """Where checkpoint projection `shard_id` goes (None: the output is not sharded)."""
        raise NotImplementedError

    def input_shard(self) -> InputShard | None:
        """This rank's input features (None: every rank takes all of them)."""
        return None

    def bind_kernels(self, kernels: KernelSet) -> None:
        self.quant_method.bind_kernels(self, kernels)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
        if shard_id is None and len(self.output_partition_sizes) > 1:
            self._load_fused(param, loaded_weight)
            return
        dst, src = param.data, loaded_weight
        out = self.output_shard(shard_id)
        if getattr(param, "per_shard", False):
            dst = dst[out.index if out is not None else 0]
        elif out is not None and param.out_axis is not None:
            dim, div = param.out_axis
            if weight_shape(src)[dim] * div < out.total:
                raise ValueError(
                    f"{self.prefix}: checkpoint tensor has {weight_shape(src)[dim]} x {div} "
                    f"output features, expected {out.total}"
                )
            what = f"{self.prefix} output features"
            dst = dst.narrow(dim, _exact(out.offset, div, what), _exact(out.size, div, what))
            src = narrow_weight(src, dim, _exact(out.start, div, what), out.size // div)
        inp = self.input_shard()
        if inp is not None and inp.size != inp.total and param.in_axis is not None:
            dim, div = param.in_axis
            what = f"{self.prefix} input features"
            src = narrow_weight(src, dim, _exact(inp.start, div, what), _exact(inp.size, div, what))
        what = self.prefix if shard_id is None else f"{self.prefix}[{shard_id}]"
        copy_weight(dst, full_weight(src), what)

    def _load_fused(self, param: nn.Parameter, loaded: Any) -> None:
        """A checkpoint that stores the projections fused: split it along the out axis."""
        if param.out_axis is None:
            raise ValueError(f"{self.prefix}: cannot split a fused tensor of this kind")
        dim, div = param.out_axis
        offset = 0
        for shard_id, rows in self.checkpoint_projections():
            part = narrow_weight(loaded, dim, offset // div, rows // div)
            self.weight_loader(param, part, shard_id)
            offset += rows

    def checkpoint_projections(self) -> list[tuple[Any, int]]:
        """(shard_id, rows in the checkpoint) of each projection fused here, in order."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def _exact(value: int, divisor: int, what: str) -> int:
    if value % divisor:
        raise ValueError(
            f"{what}: {value} is not a multiple of {divisor} (the packing or group size "
            "does not divide this tensor-parallel shard)"
        )
    return value // divisor


class ColumnParallelLinear(LinearBase):
    """y = x A^T + b with A's rows (output features) split across ranks: the output is
    this rank's slice [.., output_size / tp]."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, prefix: str = ""
    ) -> None:
        sizes = self._partition_sizes(output_size, get_tp_size(), prefix)
        super().__init__(input_size, output_size, input_size, sizes, bias, prefix)

    def _partition_sizes(self, output_size: int, tp_size: int, prefix: str) -> list[int]:
        return [divide(output_size, tp_size, f"{prefix} output size")]

    def output_shard(self, shard_id: Any) -> OutputShard | None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: {type(self).__name__} takes no shard_id")
        size = self.output_partition_sizes[0]
        return OutputShard(0, 0, size, self.tp_rank * size, self.output_size)


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

    def _partition_sizes(self, output_size: int, tp_size: int, prefix: str) -> list[int]:
        return [divide(s, tp_size, f"{prefix} output size") for s in self.output_sizes]

    def checkpoint_projections(self) -> list[tuple[Any, int]]:
        return list(enumerate(self.output_sizes))

    def output_shard(self, shard_id: Any) -> OutputShard | None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: bad shard_id {shard_id!r}")
        size = self.output_partition_sizes[shard_id]
        offset = sum(self.output_partition_sizes[:shard_id])
        return OutputShard(shard_id, offset, size, self.tp_rank * size, self.output_sizes[shard_id])


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

    def _partition_sizes(self, output_size: int, tp_size: int, prefix: str) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def checkpoint_projections(self) -> list[tuple[Any, int]]:
        kv_rows = self.total_num_kv_heads * self.head_size
        return [("q", self.total_num_heads * self.head_size), ("k", kv_rows), ("v", kv_rows)]

    def output_shard(self, shard_id: Any) -> OutputShard | None:
        kv_start = (self.tp_rank // self.num_kv_head_replicas) * self.kv_size
        kv_total = self.total_num_kv_heads * self.head_size
        if shard_id == "q":
            q_total = self.total_num_heads * self.head_size
            return OutputShard(0, 0, self.q_size, self.tp_rank * self.q_size, q_total)
        if shard_id == "k":
            return OutputShard(1, self.q_size, self.kv_size, kv_start, kv_total)
        if shard_id == "v":
            return OutputShard(2, self.q_size + self.kv_size, self.kv_size, kv_start, kv_total)
        raise ValueError(f"{self.prefix}: bad shard_id {shard_id!r}")


class RowParallelLinear(LinearBase):
    """y = x A^T + b with A's columns (input features) split across ranks: the input is
    this rank's slice [.., input_size / tp]. Partial outputs are all-reduced and the
    bias is added once, after the reduction."""

    output_sharded = False

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, prefix: str = ""
    ) -> None:
        per_partition = divide(input_size, get_tp_size(), f"{prefix} input size")
        super().__init__(input_size, output_size, per_partition, [output_size], bias, prefix)

    def output_shard(self, shard_id: Any) -> OutputShard | None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: {type(self).__name__} takes no shard_id")
        return None

    def input_shard(self) -> InputShard | None:
        size = self.input_size_per_partition
        return InputShard(self.tp_rank * size, size, self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = tp_all_reduce(self.quant_method.apply(self, x, None))
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
