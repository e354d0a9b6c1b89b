"""Mixture-of-experts layers: the router's top-k, the experts of a layer as two stacked
weights run by one fused call, and the sparse MLP block of Qwen2-MoE, Qwen3-MoE and Mixtral.

Each expert e is a SiLU-gated MLP: down_e(silu(gate_e x) * up_e x). FusedMoE holds them
stacked, `w13` [E, 2 I, H] (every expert's gate rows, then its up rows) and `w2` [E, H, I],
and runs the routed tokens of all experts in one call (moe_experts.py on CPU, triton_moe.py
on CUDA), never a Python loop over experts.

Parallelism (chosen at start, models.parallel_state):

* tensor parallel (default): every rank holds every expert, a slice of its intermediate
  dimension (gate/up rows, down columns), as a dense MLP is split;
* expert parallel (`--enable-expert-parallel`): rank r holds whole experts
  [r E / n, (r + 1) E / n); the others' routes are masked out (id -1) on it.

Tensor-parallel attention gives every rank every token, so in both layouts each rank's
output is a partial sum over its share of the work, and one all-reduce combines them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelSet
from models.layers.moe_experts import fused_experts
from models.layers.triton_moe import fused_experts_triton, triton_moe_takes
from models.layers.utils import ShardedModule, copy_weight, full_weight, new_parameter
from models.parallel_state import get_expert_parallel, tp_all_reduce
from models.quantization.base_config import (
    EXPERT_PROJECTIONS,
    FusedMoEMethodBase,
    QuantizationConfig,
    current_quant_config,
)
from models.quantization.gguf_types import GGUFWeight


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax over the experts (float32), the top k, their weights summing to one when
    `renormalize`. Returns (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(ShardedModule):
    """forward(x [T, H], router_logits [T, E]) -> [T, H], reduced over the ranks."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        prefix: str,
    ) -> None:
        super().__init__(prefix)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_parallel = get_expert_parallel() and self.tp_size > 1
        if self.expert_parallel:
            if num_experts % self.tp_size:
                raise ValueError(
                    f"{prefix}: {num_experts} experts do not divide over {self.tp_size} "
                    "ranks (--enable-expert-parallel places whole experts on each rank)"
                )
            self.num_local_experts = num_experts // self.tp_size
            self.first_expert = self.tp_rank * self.num_local_experts
            self.intermediate_size, self.intermediate_start = intermediate_size, 0
        else:
            if intermediate_size % self.tp_size:
                raise ValueError(
                    f"{prefix}: the experts' intermediate size {intermediate_size} does not "
                    f"divide over {self.tp_size} ranks (try --enable-expert-parallel)"
                )
            self.num_local_experts, self.first_expert = num_experts, 0
            self.intermediate_size = intermediate_size // self.tp_size
            self.intermediate_start = self.tp_rank * self.intermediate_size  # this rank's first
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.quant_method = _moe_method(current_quant_config(), self)
        self.quant_method.create_weights(self)
        self._loaded: set[tuple[int, str]] = set()

    def bind_kernels(self, kernels: KernelSet) -> None:
        self.quant_method.bind_kernels(self, kernels)

    def load_expert(self, expert: int, projection: str, loaded: Any, kind: str = "weight") -> None:
        """One expert's gate [I, H], up [I, H] or down [H, I] checkpoint tensor (or lazy
        slice): this rank's part of it, if the expert is on this rank. `kind` "weight", or a
        quantized checkpoint's tensor beside it (fp8 scales, AWQ/GPTQ/compressed-tensors
        packed codes, scales, zero points), given whole: the method cuts this rank's part."""
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        start, i = self.intermediate_start, self.intermediate_size
        if kind != "weight":
            self.quant_method.load_packed(self, local, projection, kind, full_weight(loaded))
            if kind in ("qweight", "weight_packed"):
                self._loaded.add((expert, projection))
            return
        part = _narrow(loaded, 1 if projection == "down" else 0, start, i)
        self.quant_method.load_weight(self, local, projection, part)
        self._loaded.add((expert, projection))

    def load_stacked(self, projection: str, loaded: Any) -> None:
        """All experts' projection in one tensor: transformers' fused layout, gate_up
        [E, 2 I, H] (gate rows first) or down [E, H, I]; or GGUF's gate, up or down, whose
        experts' rows come one after another ([E * N, K])."""
        if isinstance(loaded, GGUFWeight):  # [E * N, K] rows
            rows = loaded.shape[0] // self.num_experts
            for expert in range(self.num_experts):
                self.load_expert(expert, projection, loaded.narrow(0, expert * rows, rows))
            return
        tensor = full_weight(loaded)
        for expert in range(self.num_experts):
            if projection == "gate_up":
                full = self.full_intermediate_size
                self.load_expert(expert, "gate", tensor[expert, :full])
                self.load_expert(expert, "up", tensor[expert, full:])
            else:
                self.load_expert(expert, projection, tensor[expert])

    def fully_loaded(self) -> bool:
        local = range(self.first_expert, self.first_expert + self.num_local_experts)
        return all((e, p) in self._loaded for e in local for p in EXPERT_PROJECTIONS)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        if self.expert_parallel:
            ids = ids - self.first_expert
            ids = ids.masked_fill((ids < 0) | (ids >= self.num_local_experts), -1)
        out = self.quant_method.apply(self, x, weights, ids)
        return tp_all_reduce(out) if self.tp_size > 1 else out


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """The experts in the model's dtype, stacked: w13 [E, 2 I, H], w2 [E, H, I]."""

    def create_weights(self, layer: nn.Module) -> None:
        n, i, h = layer.num_local_experts, layer.intermediate_size, layer.hidden_size
        layer.w13 = new_parameter(n, 2 * i, h)
        layer.w2 = new_parameter(n, h, i)
        self.kernels: KernelSet | None = None

    def load_weight(self, layer: nn.Module, expert: int, projection: str, loaded: Any) -> None:
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{layer.prefix}: expert {projection} is quantized ({loaded!r})")
        i = layer.intermediate_size
        if projection == "down":
            copy_weight(layer.w2.data[expert], loaded)
        else:
            half = 0 if projection == "gate" else 1
            copy_weight(layer.w13.data[expert, half * i : (half + 1) * i], loaded)

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        self.kernels = kernels

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if self.kernels is not None and self.kernels.triton and triton_moe_takes(x):
            return fused_experts_triton(x, layer.w13, layer.w2, topk_weights, topk_ids)
        return fused_experts(x, layer.w13, layer.w2, topk_weights, topk_ids, self.kernels)


def _moe_method(config: QuantizationConfig | None, layer: FusedMoE) -> FusedMoEMethodBase:
    """The config's method for the experts; a config that quantizes other layers but has
    none for experts is an error naming it."""
    if config is None:
        return UnquantizedFusedMoEMethod()
    method = config.get_quant_method(layer, layer.prefix)
    if not isinstance(method, FusedMoEMethodBase):
        raise ValueError(
            f"{layer.prefix}: experts quantized with {config.name!r} are not supported "
            "(quantized experts: int8, fp8, gguf, awq, gptq, compressed-tensors); run this "
            "model unquantized"
        )
    return method


def _narrow(loaded: Any, dim: int, start: int, length: int) -> Any:
    """loaded[start : start + length] along dim 0 or 1: a GGUF tensor's whole rows or
    blocks, else the (lazy) tensor's slice, read."""
    if isinstance(loaded, GGUFWeight):
        return loaded.narrow(dim, start, length)
    end = start + length
    return full_weight(loaded[start:end] if dim == 0 else loaded[:, start:end])


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse decoder layer: a replicated router (`gate`), the experts and,
    for Qwen2-MoE, a shared expert scaled by sigmoid(shared_expert_gate x)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        prefix: str,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts)
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            renormalize=renormalize,
            prefix=f"{prefix}.experts",
        )
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = Router(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


class Router(nn.Module):
    """A small replicated linear layer without bias (the router, the shared expert's gate)."""

    def __init__(self, hidden_size: int, num_outputs: int) -> None:
        super().__init__()
        self.weight = new_parameter(num_outputs, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
