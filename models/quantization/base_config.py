"""The quantization seam, in vLLM's shape: a `QuantizationConfig` (one per model, read
from the checkpoint or the --quantization flag) gives each layer its method, and the
method owns the layer's weights: `create_weights` registers the parameters the checkpoint
fills, `process_weights_after_loading` turns them into what `apply` computes on, and
`bind_kernels` hands them to the kernel set once.

Linear layers are built while a config is current (`building_with`, which the model
loader enters), so the model classes need not pass it through every constructor.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kernels import KernelSet

if TYPE_CHECKING:
    from models.quantization.cpu_quant_linear import PreparedQuantWeight


class QuantizeMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor of `layer` is loaded."""
        return

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        """Prepare the loaded weights for the kernel set (again after weights change)."""
        return

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class LinearMethodBase(QuantizeMethodBase):
    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register this rank's parameters on `layer`. Each carries `weight_loader` (the
        layer's, which shards by the parameter's `out_axis` / `in_axis`: see
        models.layers.utils.set_shard_axes) unless the method loads it itself."""

    def decode_weight(self, layer: nn.Module) -> torch.Tensor | PreparedQuantWeight | None:
        """The one weight `apply` computes x W^T with, for the CPU decode loop
        (models/cpu_decode_loop.py): dense (F.linear, or a PackedWeight of the bf16
        widening kernel) or quantized (quant_linear); None where it computes another way."""
        return None


EXPERT_PROJECTIONS = ("gate", "up", "down")  # what a FusedMoE method loads per expert


class FusedMoEMethodBase(QuantizeMethodBase):
    """How a FusedMoE layer (models/layers/fused_moe.py) holds and runs its experts."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Register the storage for the layer's local experts (its geometry: num_local_experts,
        intermediate_size (this rank's), hidden_size)."""

    @abstractmethod
    def load_weight(self, layer: nn.Module, expert: int, projection: str, loaded: Any) -> None:
        """Local expert `expert`'s `projection` ("gate", "up": [I, H]; "down": [H, I]), already
        sliced to this rank: a tensor, or a GGUFWeight for the GGUF method."""

    def load_packed(
        self, layer: nn.Module, expert: int, projection: str, kind: str, tensor: torch.Tensor
    ) -> None:
        """A quantized checkpoint's tensor `kind` beside a local expert's projection weight
        (fp8's weight_scale, AWQ's qweight, ...), whole: the method cuts this rank's part."""
        raise ValueError(
            f"{layer.prefix}: expert {projection} has a {kind}, which this layer's experts "
            f"({type(self).__name__}) do not take"
        )

    @abstractmethod
    def apply(  # type: ignore[override]
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's share of the experts' weighted sum (models/layers/moe_experts.py)."""


class QuantizationConfig(ABC):
    """One model's quantization. `name` is its --quantization value."""

    name: ClassVar[str]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """From a checkpoint's `quantization_config` (an online method ignores it)."""
        return cls()

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for `layer` (None: unquantized)."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise if the model cannot run with activations in `dtype`."""
        return


_current: ContextVar[QuantizationConfig | None] = ContextVar("quant_config", default=None)


@contextlib.contextmanager
def building_with(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers built inside take their methods from `config`."""
    token = _current.set(config)
    try:
        yield
    finally:
        _current.reset(token)


def current_quant_config() -> QuantizationConfig | None:
    return _current.get()
