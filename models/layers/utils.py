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


def set_shard_axes(
    param: nn.Parameter,
    out: tuple[int, int] | None = None,
    inp: tuple[int, int] | None = None,
) -> None:
    """Say how a linear layer shards `param`: `out` = (tensor dim, output features per
    index along it) for column-parallel sharding, `inp` the same for input features (row
    parallel). None: that axis is not sharded (replicated). A packed int4 tensor [K, N/8]
    has out=(1, 8); a group scale [K/g, N] has out=(1, 1), inp=(0, g)."""
    param.out_axis = out
    param.in_axis = inp


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
