"""--quantization fp8: float8_e4m3fn weights with one float32 scale per output feature.

Two sources, one computed form (cpu_fp8_linear.Fp8Weight):
* an fp8 checkpoint (quantization_config quant_method "fp8", as vLLM and llm-compressor
  write it): `weight` float8_e4m3fn [N, K] and `weight_scale`, per tensor (a scalar, one
  per checkpoint projection of a fused layer: each fills its projection's rows, so no
  requantization is needed) or per channel [N, 1]; with activation_scheme "static" also
  a per-tensor `input_scale`;
* a 16/32-bit checkpoint quantized per output channel at load (scale = max|row| / 448).

On a CPU the weights stay fp8 (weight-only: the C++ kernel, or the torch path); a static
input_scale is only used on CUDA, where a GPU with fp8 (compute capability 8.9 or more)
runs torch._scaled_mm on fp8 activations, and any other GPU computes weight-only.
A mixture of experts' experts are quantized at load too (Fp8MoEMethod, weight-only); an fp8
checkpoint's experts load as stored (Fp8CheckpointMoEMethod: fp8 weights with their scales,
per tensor or per channel) and compute weight-only, their input_scale unused.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernels import KernelSet
from models.layers.fused_moe import FusedMoE
from models.layers.linear import LinearBase, UnquantizedLinearMethod
from models.layers.moe_experts import ExpertWeights
from models.layers.utils import full_weight, set_shard_axes, set_weight_attrs, weight_shape
from models.quantization.base_config import (
    EXPERT_PROJECTIONS,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from models.quantization.cpu_fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Weight,
    PreparedFp8Weight,
    fp8_kernel,
    fp8_linear,
    prepare_fp8_weight,
    quantize_fp8_per_channel,
    torch_fp8_linear,
)
from models.quantization.quant_moe import QuantMoEMethodBase, StackedQuantWeight, expert_name
from models.quantization.triton_quant_linear import FP8_BITS

# A fused layer's name -> the checkpoint projections it holds (for ignored_layers).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Fp8LinearMethod(LinearMethodBase):
    """The weights of an fp8 checkpoint (`static_input_scale`: it has input_scale too)."""

    def __init__(self, static_input_scale: bool = False) -> None:
        self.static_input_scale = static_input_scale

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        rows = sum(output_partition_sizes)
        weight = _frozen(torch.empty(rows, input_size_per_partition, dtype=FP8_DTYPE))
        set_shard_axes(weight, out=(0, 1), inp=(1, 1))
        set_weight_attrs(weight, {"weight_loader": _fp8_loader(layer)})
        layer.weight = weight
        weight_scale = _frozen(torch.empty(rows, 1, dtype=torch.float32))
        set_shard_axes(weight_scale, out=(0, 1))
        set_weight_attrs(weight_scale, {"weight_loader": _scale_loader(layer)})
        layer.weight_scale = weight_scale
        if self.static_input_scale:
            input_scale = _frozen(torch.empty(len(output_partition_sizes), dtype=torch.float32))
            set_shard_axes(input_scale)
            set_weight_attrs(
                input_scale, {"per_shard": True, "weight_loader": _scale_loader(layer)}
            )
            layer.input_scale = input_scale
        else:
            layer.input_scale = None
        layer.prepared_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight_scale = _frozen(layer.weight_scale.data.reshape(-1))
        if layer.input_scale is not None:  # the fused projections share their input
            layer.input_scale = _frozen(layer.input_scale.data.max())

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        fp8 = Fp8Weight(layer.weight.data, layer.weight_scale.data)
        layer.prepared_weight = prepare_fp8_weight(fp8, kernels)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        prepared = layer.prepared_weight
        if x.is_cuda and has_fp8_matmul(x.device):
            return scaled_mm_linear(x, prepared.weight, layer.input_scale, bias)
        return fp8_linear(x, prepared, bias)


class Fp8OnlineLinearMethod(Fp8LinearMethod):
    """Loads the dense weight as the unquantized method does, then quantizes it."""

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        UnquantizedLinearMethod().create_weights(layer, *args, **kwargs)
        layer.input_scale = None
        layer.prepared_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        fp8 = quantize_fp8_per_channel(layer.weight.data)
        layer.weight = _frozen(fp8.weight)
        layer.weight_scale = _frozen(fp8.scale)


# An expert's rows up to here take the fp8 kernel, more a matmul on its dequantized weight:
# on an expert's gate/up (512 x 1024), AMD EPYC Zen 3, 2 threads, us per call: 8 rows 120
# against 375, 16 rows 262 against 424, 32 rows 529 against 554.
EXPERT_KERNEL_ROWS = 32


class _Fp8ExpertLinear(ExpertWeights):
    """One projection of every expert, fp8 [E, N, K] with scales [E, N], for
    fused_experts_torch (weight-only; the C++ kernel where bound)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight, self.scale = weight, scale
        self.kernel: ModuleType | None = None

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        w = Fp8Weight(self.weight[expert], self.scale[expert])
        return fp8_linear(x, PreparedFp8Weight(w, self.kernel if x.device.type == "cpu" else None))


class Fp8MoEMethod(QuantMoEMethodBase):
    """--quantization fp8 on a 16/32-bit mixture of experts: each expert's projections
    quantized per output channel as they load (gate and up stacked as one weight)."""

    def to_part(self, layer: nn.Module, projection: str, loaded: Any) -> Fp8Weight:
        if not isinstance(loaded, torch.Tensor) or loaded.dtype == FP8_DTYPE:
            raise ValueError(f"{layer.prefix}: fp8 quantizes 16/32-bit experts, got {loaded!r}")
        return quantize_fp8_per_channel(loaded)

    def stack(self, layer: nn.Module, gate: list, up: list, down: list) -> None:
        def stacked(parts: list[list[Fp8Weight]]) -> _Fp8ExpertLinear:
            weight = torch.stack([torch.cat([p.weight for p in expert]) for expert in parts])
            scale = torch.stack([torch.cat([p.scale for p in expert]) for expert in parts])
            return _Fp8ExpertLinear(weight.to(self.device), scale.to(self.device))

        self.w13 = stacked([[g, u] for g, u in zip(gate, up, strict=True)])
        self.w2 = stacked([[d] for d in down])

    def bind_cpu(self, kernels: KernelSet, moe: ModuleType) -> tuple[list[Any], Any] | None:
        fp8 = fp8_kernel(kernels)
        self.w13.kernel = self.w2.kernel = fp8
        if fp8 is None:
            return None
        lent = fp8.c_api()

        def bound(w: _Fp8ExpertLinear) -> Any:
            return moe.Fp8Experts(w.weight.view(torch.uint8), w.scale, EXPERT_KERNEL_ROWS, lent)

        return [bound(self.w13)], bound(self.w2)

    def torch_weights(self) -> tuple[ExpertWeights, ExpertWeights]:
        return self.w13, self.w2

    def triton_experts(self) -> tuple[list[StackedQuantWeight], StackedQuantWeight]:
        return [_as_stacked(self.w13)], _as_stacked(self.w2)


def _as_stacked(w: _Fp8ExpertLinear) -> StackedQuantWeight:
    """fp8 values in one block of K, a scale per output feature (views, no copy)."""
    return StackedQuantWeight(FP8_BITS, w.weight, w.scale.unsqueeze(-1), None, w.weight.shape[2])


class Fp8CheckpointMoEMethod(Fp8MoEMethod):
    """An fp8 checkpoint's experts as stored: each projection's float8_e4m3fn weight and its
    weight_scale (per tensor: one value for its rows; per channel: one per row), stacked as
    Fp8MoEMethod's. Weight-only: an input_scale is accepted and not used (activations stay
    in the model's dtype, as for every fp8 expert here)."""

    def create_weights(self, layer: nn.Module) -> None:
        super().create_weights(layer)
        self.scales: dict[str, dict[int, torch.Tensor]] = {p: {} for p in EXPERT_PROJECTIONS}

    def to_part(self, layer: nn.Module, projection: str, loaded: Any) -> torch.Tensor:
        weight = full_weight(loaded)
        if weight.dtype != FP8_DTYPE:
            raise ValueError(
                f"fp8 checkpoint: {layer.prefix} expert {projection} weight is {weight.dtype}, "
                "not float8_e4m3fn"
            )
        return weight

    def load_packed(
        self, layer: nn.Module, expert: int, projection: str, kind: str, tensor: torch.Tensor
    ) -> None:
        """A weight_scale per tensor, or per output row (gate and up: this rank's rows)."""
        if kind == "input_scale":
            return
        if kind != "weight_scale":
            super().load_packed(layer, expert, projection, kind, tensor)
        scale = tensor.float().reshape(-1)
        if scale.numel() > 1 and projection != "down":
            start = layer.intermediate_start
            scale = scale[start : start + layer.intermediate_size]
        self.scales[projection][expert] = scale

    def expert_part(self, layer: nn.Module, projection: str, expert: int) -> Fp8Weight:
        weight = self.parts[projection][expert]
        scale = self.scales[projection].pop(expert, None)
        name = expert_name(layer, projection, expert)
        if scale is None:
            raise ValueError(f"fp8 checkpoint: {name} has no weight_scale")
        if scale.numel() not in (1, weight.shape[0]):
            raise ValueError(
                f"fp8 checkpoint: {name} weight_scale has {scale.numel()} values for "
                f"{weight.shape[0]} rows"
            )
        return Fp8Weight(weight, scale.expand(weight.shape[0]).contiguous())


class Fp8Config(QuantizationConfig):
    """`checkpoint`: the weights are stored fp8 (else quantized at load)."""

    name = "fp8"

    def __init__(
        self,
        checkpoint: bool = False,
        static_input_scale: bool = False,
        ignored_layers: tuple[str, ...] = (),
    ) -> None:
        self.checkpoint = checkpoint
        self.static_input_scale = static_input_scale
        self.ignored_layers = frozenset(ignored_layers)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        if config.get("quant_method") != "fp8":
            return cls()
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8 activation_scheme must be static or dynamic, got {scheme!r}")
        if config.get("weight_block_size") is not None:
            raise ValueError(
                f"fp8 checkpoint: block-wise weight scales (weight_block_size "
                f"{config['weight_block_size']}) are not supported; per-tensor and "
                "per-channel scales are"
            )
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoint: format {config['fmt']!r} is not supported (e4m3)")
        ignored = tuple(config.get("ignored_layers") or ())
        return cls(True, scheme == "static", ignored)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, FusedMoE):
            return Fp8CheckpointMoEMethod() if self.checkpoint else Fp8MoEMethod()
        if not isinstance(layer, LinearBase) or self._ignored(prefix):
            return None
        if self.checkpoint:
            return Fp8LinearMethod(self.static_input_scale)
        return Fp8OnlineLinearMethod()

    def _ignored(self, prefix: str) -> bool:
        """Whether the checkpoint keeps the layer `prefix` unquantized: all of its fused
        projections are in ignored_layers (some but not all is an error)."""
        head, _, name = prefix.rpartition(".")
        names = [f"{head}.{part}" if head else part for part in _FUSED.get(name, (name,))]
        ignored = [n in self.ignored_layers for n in names]
        if any(ignored) and not all(ignored):
            raise ValueError(f"fp8 checkpoint: {prefix} fuses {names}, of which only some are fp8")
        return all(ignored)


def _fp8_loader(layer: LinearBase):
    """The layer's loader, for float8_e4m3fn checkpoint tensors only (a 16-bit tensor
    would be silently rounded to fp8)."""

    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        dtype = loaded.dtype if isinstance(loaded, torch.Tensor) else loaded.get_dtype()
        if dtype not in (FP8_DTYPE, "F8_E4M3"):
            name = layer.prefix if shard_id is None else f"{layer.prefix}[{shard_id}]"
            raise ValueError(f"fp8 checkpoint: {name}.weight is {dtype}, not float8_e4m3fn")
        layer.weight_loader(param, loaded, shard_id)

    return load


def _scale_loader(layer: LinearBase):
    """The layer's loader, but a single value (a per-tensor scale, 0-d or [1]) fills what
    its projection holds: its rows of a per-row parameter, or its entry of a per-shard
    one (all of them for a checkpoint that stores the projections fused)."""

    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if math.prod(weight_shape(loaded)) != 1:
            layer.weight_loader(param, loaded, shard_id)
            return
        fused = shard_id is None and len(layer.output_partition_sizes) > 1
        out = None if fused else layer.output_shard(shard_id)
        dst = param.data
        if out is not None:
            per_shard = getattr(param, "per_shard", False)
            dst = (
                dst[out.index : out.index + 1] if per_shard else dst.narrow(0, out.offset, out.size)
            )
        dst.fill_(full_weight(loaded).reshape(()).item())

    return load


def has_fp8_matmul(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_linear(
    x: torch.Tensor,
    w: Fp8Weight,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (scale * W)^T (+ bias) on fp8 tensor cores (untested here: no GPU): x quantized
    per tensor with `input_scale` (None: max|x| / 448 now), the products in float32, then
    each output feature's scale."""
    rows = x.reshape(-1, x.shape[-1])
    n, k = w.weight.shape
    if n % 16 or k % 16:  # torch._scaled_mm's shape rule
        return torch_fp8_linear(x, w, bias)
    if input_scale is None:
        input_scale = rows.abs().amax().float().clamp_min(1e-12) / FP8_MAX
    x_fp8 = (rows.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    out = torch._scaled_mm(
        x_fp8, w.weight.t(), scale_a=input_scale.float(), scale_b=one, out_dtype=torch.float32
    )
    out = out * w.scale
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
