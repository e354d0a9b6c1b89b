"""Quantized experts: a FusedMoE layer (models/layers/fused_moe.py) whose expert weights
are quantized. `QuantMoEMethodBase` loads them one expert projection at a time, stacks
them once loaded, and runs them through the C++ kernel (cpu_quant_moe.cpp) on the CPU,
else through `fused_experts_torch`. Its methods: `BlockQuantMoEMethod` here (int8.py's
per-channel int8 at load, gguf.py's ggml types), `Fp8MoEMethod` in fp8.py.

A BlockQuantMoEMethod holds each projection of the local experts stacked
(`StackedQuantWeight`, one format for all experts): gate and up as one [2 I, H] weight per
expert where their formats agree (else as two), down [H, I]. The C++ kernel runs every
routed expert's projections with the block-quantized linear kernels (int8 activations,
or float32 products when exact; on strips where the build computes on strips, the one
copy kept); on CUDA two Triton launches for every expert (triton_quant_moe.py) where
gate and up are one weight; else the torch path with `quant_linear` (the Triton matmul
on CUDA, the weight dequantized per call otherwise).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernels import KernelSet
from kernels.libraries import QUANT_MOE
from models.layers.moe_experts import ExpertWeights, fused_experts_torch
from models.quantization.base_config import EXPERT_PROJECTIONS, FusedMoEMethodBase
from models.quantization.block_quant import BlockQuantWeight
from models.quantization.cpu_quant_linear import PreparedQuantWeight, quant_kernel, quant_linear
from models.quantization.strips import StripQuantWeight, to_strips
from models.quantization.triton_quant_moe import (
    fused_quant_experts_triton,
    triton_quant_moe_takes,
)


@dataclass(frozen=True)
class GatheredWeight:
    """An expert weight whose input feature j is x's feature index[j] (GPTQ act-order:
    the features reordered so that each group is contiguous)."""

    weight: BlockQuantWeight
    index: torch.Tensor


@dataclass(frozen=True)
class StackedQuantWeight:
    """One projection of every local expert: expert e's BlockQuantWeight (or, with
    `strips`, StripQuantWeight) is (q[e], scales[e], mins[e], bits, block_size), and its
    input is x gathered by input_index[e] where there is one ([E, K] int64)."""

    bits: int
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    block_size: int
    strips: bool = False
    input_index: torch.Tensor | None = None

    @property
    def format(self) -> tuple:
        """What experts must share to be concatenated (BlockQuantWeight.format)."""
        return self.bits, self.block_size, self.scales.dtype, self.mins is None

    @classmethod
    def stack(cls, parts: list[BlockQuantWeight | GatheredWeight]) -> StackedQuantWeight:
        weights = _weights(parts)
        first = weights[0]
        mins = None if first.mins is None else torch.stack([w.mins for w in weights])
        q, scales = (
            torch.stack([w.qweight for w in weights]),
            torch.stack([w.scales for w in weights]),
        )
        return cls(first.bits, q, scales, mins, first.block_size, input_index=_input_index(parts))

    def to(self, device: torch.device) -> StackedQuantWeight:
        mins = None if self.mins is None else self.mins.to(device)
        index = None if self.input_index is None else self.input_index.to(device)
        q, scales = self.q.to(device), self.scales.to(device)
        return StackedQuantWeight(self.bits, q, scales, mins, self.block_size, self.strips, index)

    def expert(self, e: int) -> BlockQuantWeight:
        """Expert e's weight in the row layout (a copy when held in strips)."""
        mins = None if self.mins is None else self.mins[e]
        if self.strips:
            strips = StripQuantWeight(self.bits, self.q[e], self.scales[e], mins, self.block_size)
            return strips.row_weight()
        return BlockQuantWeight(self.bits, self.q[e], self.scales[e], mins, self.block_size)

    def in_strips(self) -> StackedQuantWeight | None:
        """Every expert regrouped into strips; None when its rows are not whole strips."""
        experts = [to_strips(self.expert(e)) for e in range(self.q.shape[0])]
        if any(s is None for s in experts):
            return None
        mins = None if self.mins is None else torch.stack([s.mins for s in experts])
        q, scales = torch.stack([s.q for s in experts]), torch.stack([s.scales for s in experts])
        return StackedQuantWeight(
            self.bits, q, scales, mins, self.block_size, True, self.input_index
        )

    def gather_input(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return x if self.input_index is None else x.index_select(-1, self.input_index[e])


def _weights(parts: list[BlockQuantWeight | GatheredWeight]) -> list[BlockQuantWeight]:
    return [p.weight if isinstance(p, GatheredWeight) else p for p in parts]


def _input_index(parts: list[BlockQuantWeight | GatheredWeight]) -> torch.Tensor | None:
    """The experts' input indexes stacked ([E, K]); None where no expert gathers."""
    if not any(isinstance(p, GatheredWeight) for p in parts):
        return None
    k = next(p.index.numel() for p in parts if isinstance(p, GatheredWeight))
    return torch.stack(
        [p.index if isinstance(p, GatheredWeight) else torch.arange(k) for p in parts]
    )


def stack_gate_up(
    gate: list[BlockQuantWeight | GatheredWeight], up: list[BlockQuantWeight | GatheredWeight]
) -> list[StackedQuantWeight]:
    """gate and up as one [2 I, H] weight per expert where one format holds both and they
    take the same input."""
    g, u = StackedQuantWeight.stack(gate), StackedQuantWeight.stack(up)
    a, b = g.input_index, u.input_index
    same_input = a is b is None or (a is not None and b is not None and torch.equal(a, b))
    if not same_input or g.format != u.format:
        return [g, u]
    mins = None if g.mins is None else torch.cat([g.mins, u.mins], dim=1)
    q, scales = torch.cat([g.q, u.q], dim=1), torch.cat([g.scales, u.scales], dim=1)
    return [StackedQuantWeight(g.bits, q, scales, mins, g.block_size, input_index=a)]


def expert_name(layer: nn.Module, projection: str, expert: int) -> str:
    """Local expert `expert`'s projection, as an error names it."""
    return f"{layer.prefix} expert {expert + layer.first_expert} {projection}"


def quant_moe_kernel(kernels: KernelSet) -> ModuleType | None:
    return kernels.cpp(QUANT_MOE)


class QuantMoEMethodBase(FusedMoEMethodBase):
    """Experts that load one expert projection at a time (`to_part`), are stacked once
    loaded (`stack`), and run through the C++ kernel where `bind_cpu` bound them, else
    through fused_experts_torch over `torch_weights`."""

    def create_weights(self, layer: nn.Module) -> None:
        self.parts: dict[str, dict[int, Any]] = {p: {} for p in EXPERT_PROJECTIONS}
        self.kernel: ModuleType | None = None
        self.kernel_experts: tuple[list[Any], Any] | None = None  # (gate/up parts, down)
        self.triton = False
        self.device = torch.get_default_device()  # the model's, as the layer is built

    @abstractmethod
    def to_part(self, layer: nn.Module, projection: str, loaded: Any) -> Any:
        """What the checkpoint gave for a local expert's projection, as this method holds it."""

    @abstractmethod
    def stack(self, layer: nn.Module, gate: list, up: list, down: list) -> None:
        """Hold the experts' parts (in expert order) stacked, on self.device."""

    @abstractmethod
    def bind_cpu(self, kernels: KernelSet, moe: ModuleType) -> tuple[list[Any], Any] | None:
        """The kernel's experts objects (gate/up parts, down); None where it cannot run."""

    @abstractmethod
    def torch_weights(self) -> tuple[ExpertWeights, ExpertWeights]:
        """(gate/up, down) for fused_experts_torch."""

    @abstractmethod
    def triton_experts(self) -> tuple[list[StackedQuantWeight], StackedQuantWeight]:
        """(gate/up parts, down) as the fused Triton launches read them (triton_quant_moe)."""

    def load_weight(self, layer: nn.Module, expert: int, projection: str, loaded: Any) -> None:
        self.parts[projection][expert] = self.to_part(layer, projection, loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        experts = range(layer.num_local_experts)
        self.stack(
            layer, *([self.expert_part(layer, p, e) for e in experts] for p in EXPERT_PROJECTIONS)
        )
        self.parts = {}

    def expert_part(self, layer: nn.Module, projection: str, expert: int) -> Any:
        """A local expert's projection as `stack` takes it: what `to_part` gave."""
        return self.parts[projection][expert]

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        self.triton = kernels.triton
        self.kernel = quant_moe_kernel(kernels) if self.device.type == "cpu" else None
        self.kernel_experts = None if self.kernel is None else self.bind_cpu(kernels, self.kernel)

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        experts = layer.num_local_experts
        if self.triton and x.is_cuda:
            gate_up, down = self.triton_experts()
            if triton_quant_moe_takes(x, gate_up, down):
                return fused_quant_experts_triton(x, gate_up[0], down, topk_weights, topk_ids)
        if self.kernel_experts is not None and x.device.type == "cpu":
            gate_up, down = self.kernel_experts
            out = self.kernel.fused_quant_experts(x, gate_up, down, topk_weights, topk_ids, experts)
            if out is not None:
                return out
        w13, w2 = self.torch_weights()
        return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, experts)


class _ExpertLinear(ExpertWeights):
    """One projection's parts (outputs side by side) for fused_experts_torch."""

    def __init__(self, parts: list[StackedQuantWeight], triton: bool) -> None:
        self.parts, self.triton = parts, triton

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        outs = [
            quant_linear(
                p.gather_input(x, expert),
                PreparedQuantWeight(p.expert(expert), None, triton=self.triton),
            )
            for p in self.parts
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class BlockQuantMoEMethod(QuantMoEMethodBase):
    """Experts held as StackedQuantWeights (`to_part` gives one BlockQuantWeight per local
    expert and projection), computed by the block-quantized linear kernels."""

    gate_up: list[StackedQuantWeight]
    down: StackedQuantWeight

    def stack(self, layer: nn.Module, gate: list, up: list, down: list) -> None:
        for projection, parts in (("gate", gate), ("up", up), ("down", down)):
            weights = _weights(parts)
            if any(v.format != weights[0].format for v in weights):
                raise ValueError(f"{layer.prefix}: its experts' {projection} formats differ")
        self.gate_up = [w.to(self.device) for w in stack_gate_up(gate, up)]
        self.down = StackedQuantWeight.stack(down).to(self.device)

    def bind_cpu(self, kernels: KernelSet, moe: ModuleType) -> tuple[list[Any], Any] | None:
        quant = quant_kernel(kernels)
        if quant is None:
            return None
        strips = bool(quant.strip_width())
        exact = not kernels.int8_activations
        lent = quant.c_api()

        def bound(w: StackedQuantWeight) -> tuple[StackedQuantWeight, Any]:
            if strips and not w.strips:
                w = w.in_strips() or w
            kernel = ("strip_" if w.strips else "") + ("linear_f32" if exact else "linear_int8")
            return w, moe.BlockQuantExperts(
                w.q, w.scales, w.mins, w.bits, w.block_size, lent, kernel, w.input_index
            )

        gate_up = [bound(w) for w in self.gate_up]
        down = bound(self.down)
        self.gate_up, self.down = [w for w, _ in gate_up], down[0]  # the one copy: strips
        return [k for _, k in gate_up], down[1]

    def torch_weights(self) -> tuple[ExpertWeights, ExpertWeights]:
        return _ExpertLinear(self.gate_up, self.triton), _ExpertLinear([self.down], self.triton)

    def triton_experts(self) -> tuple[list[StackedQuantWeight], StackedQuantWeight]:
        return self.gate_up, self.down
