"""Weight-loading helpers shared by the layers.

A loaded weight is either a torch.Tensor or a lazy safetensors slice (what
`safe_open(...).get_slice(name)` returns): indexing a slice reads only the indexed
part from disk, so each rank reads only its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.parallel_state import get_tp_rank, get_tp_size

WeightLoader = Callable[..., None]


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        assert not hasattr(param, key), f"parameter already has attribute {key!r}"
        setattr(param, key, value)


def new_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised inference parameter (no grad) on the default device/dtype."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ShardedModule(nn.Module):
    """A layer holding this rank's shard of its weights; `prefix` names it in errors."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.prefix = prefix

    def load_rank_slice(self, param: nn.Parameter, loaded: Any, shard_id: Any, dim: int) -> None:
        """Copy this rank's slice along `dim` of the full checkpoint weight (each rank
        holds param.shape[dim] of it; one rank, the whole weight). No shard_id here."""
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: {type(self).__name__} takes no shard_id")
        size = param.shape[dim]
        if self.tp_size == 1:
            shard = full_weight(loaded)
        else:
            shard = narrow_weight(loaded, dim, self.tp_rank * size, size)
        copy_weight(param.data, shard, self.prefix)


def register_linear_params(
    module: nn.Module,
    out_features: int,
    in_features: int,
    bias: bool,
    bias_loader: WeightLoader | None = None,
) -> None:
    """`module.weight` [out_features, in_features], loaded by `module.weight_loader`, and
    `module.bias` [out_features] (or None), loaded by `bias_loader` (default the same)."""
    module.weight = new_parameter(out_features, in_features)
    set_weight_attrs(module.weight, {"weight_loader": module.weight_loader})
    if bias:
        module.bias = new_parameter(out_features)
        set_weight_attrs(module.bias, {"weight_loader": bias_loader or module.weight_loader})
    else:
        module.register_parameter("bias", None)


def weight_shape(loaded: Any) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[..., start:start+length, ...] along `dim`, reading only that part."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def full_weight(loaded: Any) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded
    if len(loaded.get_shape()) == 0:
        raise ValueError("0-d safetensors slices must be loaded as tensors")
    return loaded[:]


def copy_weight(param: torch.Tensor, value: torch.Tensor, what: str = "") -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"shape mismatch loading {what or 'weight'}: parameter {tuple(param.shape)}, "
            f"checkpoint shard {tuple(value.shape)}"
        )
    param.copy_(value)


@torch.no_grad()
@torch.no_grad()
def default_weight_loader(param: nn.Parameter, loaded_weight: Any, shard_id: Any = None) -> None:
    """Copy a replicated (unsharded) weight whole."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter got shard_id {shard_id!r}")
    copy_weight(param.data, full_weight(loaded_weight))


def divide(numerator: int, denominator: int, what: str = "") -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what or numerator} ({numerator}) is not divisible by tensor parallel size "
            f"{denominator}"
        )
    return numerator // denominator
