"""GGUF weights served as they are stored: each linear layer's tensors (one per fused
projection: q/k/v, gate/up, which a GGUF file may store in different types) are sliced
to this rank, converted once into BlockQuantWeights, and computed on by the
block-quantized kernels (a mixture of experts' experts too: quant_moe.py). The token
embedding looks up and dequantizes only the rows it needs; the LM head (tied to it or
not) is a quantized linear layer over the vocabulary. F32/F16/BF16 tensors stay dense."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelSet
from models.layers.embedding import VocabParallelEmbedding
from models.layers.fused_moe import FusedMoE
from models.layers.linear import LinearBase
from models.layers.utils import set_weight_attrs
from models.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from models.quantization.block_quant import BlockQuantWeight
from models.quantization.cpu_quant_linear import (
    PreparedQuantWeight,
    prepare_quant_weight,
    quant_linear,
)
from models.quantization.gguf_types import GGUFWeight
from models.quantization.quant_moe import BlockQuantMoEMethod

Part = BlockQuantWeight | torch.Tensor


def _placeholder(loader: Any) -> nn.Parameter:
    """The parameter a GGUF tensor is loaded through (its bytes are kept elsewhere)."""
    param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
    set_weight_attrs(param, {"weight_loader": loader})
    return param


def _to_part(weight: GGUFWeight | torch.Tensor, name: str, dtype: torch.dtype) -> Part:
    if isinstance(weight, GGUFWeight):
        return weight.to_block_quant(name)
    return weight.to(dtype)


def _concat(parts: list[Part]) -> list[Part]:
    """Parts of the same kind concatenated along the output features; else as they are."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return [torch.cat(parts)]
    first = parts[0]
    if not all(isinstance(p, BlockQuantWeight) and p.format == first.format for p in parts):
        return parts
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return [
        BlockQuantWeight(
            first.bits,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.block_size,
        )
    ]


class PartsLinear:
    """y = x W^T over W held as parts along the output features. Only the prepared parts
    are kept (a part in strips is the one copy of its weight)."""

    def __init__(self, parts: list[Part]) -> None:
        self.prepared: list[PreparedQuantWeight | torch.Tensor] = list(parts)
        self.bind_kernels(KernelSet())  # the torch code until the layer's set is bound

    def bind_kernels(self, kernels: KernelSet) -> None:
        self.prepared = [
            p if isinstance(p, torch.Tensor) else prepare_quant_weight(p, kernels)
            for p in self.prepared
        ]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.prepared) == 1:
            return _part_linear(x, self.prepared[0], bias)
        out = torch.cat([_part_linear(x, p) for p in self.prepared], dim=-1)
        return out if bias is None else out + bias


def _part_linear(
    x: torch.Tensor, part: PreparedQuantWeight | torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(part, torch.Tensor):
        return F.linear(x, part, bias)
    return quant_linear(x, part, bias)


class GGUFLinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        self.dtype = params_dtype
        self.parts: dict[int, Part] = {}
        self.linear: PartsLinear | None = None

        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            self._load(layer, loaded, shard_id)

        layer.weight = _placeholder(load)

    def _load(self, layer: LinearBase, loaded: Any, shard_id: Any) -> None:
        if shard_id is None and len(layer.output_partition_sizes) > 1:
            raise ValueError(f"{layer.prefix}: a fused GGUF tensor is not supported")
        name = layer.prefix if shard_id is None else f"{layer.prefix}[{shard_id}]"
        out, inp = layer.output_shard(shard_id), layer.input_shard()
        rows, cols = tuple(loaded.shape)
        expected = (
            out.total if out is not None else layer.output_size,
            inp.total if inp is not None else layer.input_size,
        )
        if (rows, cols) != expected:
            raise ValueError(f"{name}: GGUF tensor is {rows} x {cols}, expected {expected}")
        if out is not None:
            loaded = loaded.narrow(0, out.start, out.size)
        if inp is not None and inp.size != inp.total:
            loaded = loaded.narrow(1, inp.start, inp.size)
        self.parts[out.index if out is not None else 0] = _to_part(loaded, name, self.dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.linear = PartsLinear(_concat([self.parts[i] for i in sorted(self.parts)]))
        self.parts = {}

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        self.linear.bind_kernels(kernels)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.linear(x, bias)

    def decode_weight(self, layer: nn.Module) -> torch.Tensor | PreparedQuantWeight | None:
        prepared = self.linear.prepared
        return prepared[0] if len(prepared) == 1 else None


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """This rank's rows of a vocabulary-parallel table (models.layers.embedding): looked up
    by the embedding, multiplied by the LM head. A tied head shares this method."""

    def create_weights(self, layer: nn.Module, params_dtype: torch.dtype) -> None:
        self.dtype = params_dtype
        self.table: Part | None = None
        self.linear: PartsLinear | None = None

        def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            if shard_id is not None:
                raise ValueError(f"{layer.prefix}: embedding takes no shard_id")
            shape = tuple(loaded.shape)
            if shape != (layer.num_embeddings, layer.embedding_dim):
                raise ValueError(
                    f"{layer.prefix}: GGUF tensor is {shape}, expected "
                    f"{(layer.num_embeddings, layer.embedding_dim)}"
                )
            rows = loaded.narrow(0, layer.vocab_start_index, layer.num_real_rows)
            self.table = _to_part(rows, layer.prefix, self.dtype)

        layer.weight = _placeholder(load)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.linear is None:  # once, though a tied table is reached twice
            self.linear = PartsLinear([self.table])
            self.table = None  # kept once, by the LM head's part

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        self.linear.bind_kernels(kernels)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (local to this rank, each < num_real_rows), dequantized."""
        (table,) = self.linear.prepared
        if isinstance(table, torch.Tensor):
            return F.embedding(ids, table)
        rows = table.rows(ids.reshape(-1))
        return rows.dequantize(self.dtype).reshape(*ids.shape, -1)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of this rank's vocabulary shard, padding columns zero."""
        logits = self.linear(x, bias)
        pad = layer.num_embeddings_per_partition - logits.shape[-1]
        return F.pad(logits, (0, pad)) if pad else logits


class GGUFMoEMethod(BlockQuantMoEMethod):
    """A GGUF file's experts, each projection in its ggml type. Experts stored unquantized
    (F32/F16/BF16) are refused: serve such a model from its HF folder."""

    def to_part(self, layer: nn.Module, projection: str, loaded: Any) -> BlockQuantWeight:
        if not isinstance(loaded, GGUFWeight):
            raise ValueError(
                f"{layer.prefix}: the experts' {projection} weights are unquantized "
                f"({getattr(loaded, 'dtype', type(loaded).__name__)}) in this GGUF file; "
                "GGUF experts must be of a quantized ggml type"
            )
        return loaded.to_block_quant(f"{layer.prefix}.{projection}")


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, FusedMoE):
            return GGUFMoEMethod()
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod()
        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod()
        return None
