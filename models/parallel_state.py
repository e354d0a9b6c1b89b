"""Tensor-parallel process group state and collectives.

One process per rank; the tensor-parallel group is the whole world. With world size 1
(or before `init_distributed`) every helper is an identity and torch.distributed is
never touched, so models run unchanged in a single process.

A worker initialises it once, before building the model:

    init_distributed(rank, world_size, "file:///tmp/private-folder/rendezvous", device=device)
    model = load_model(path, dtype, device)
    ...
    destroy_distributed()
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None
_BACKEND: str | None = None
# MoE layers place whole experts on the ranks instead of slicing each (models built after
# set_expert_parallel; the worker sets it from --enable-expert-parallel).
_EXPERT_PARALLEL = False


def init_distributed(
    rank: int, world_size: int, init_method: str, device: torch.device | str | None = None
) -> None:
    """Join the tensor-parallel group as `rank` of `world_size`: "nccl" when the device
    (or, with no device given, the machine) is CUDA, "gloo" otherwise. For CUDA the
    current device is set to `device` first. World size 1 does not initialise
    torch.distributed.

    A `file://` rendezvous means every rank is on this host: gloo then binds its sockets
    on the loopback interface only (unless GLOO_SOCKET_IFNAME says otherwise), instead
    of the address the host name resolves to.
    """
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _BACKEND
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world size {world_size}")
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    if world_size == 1:
        _TP_RANK, _TP_SIZE, _TP_GROUP, _BACKEND = 0, 1, None, None
        return
    on_cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if init_method.startswith("file://"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    dist.init_process_group(
        backend="nccl" if on_cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
    )
    _TP_GROUP = dist.group.WORLD
    _BACKEND = dist.get_backend(_TP_GROUP)
    _TP_RANK = rank
    _TP_SIZE = world_size


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def destroy_distributed() -> None:
    """Leave the group and go back to world size 1."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _BACKEND
    if _TP_GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP, _BACKEND = 0, 1, None, None


def set_expert_parallel(enabled: bool) -> None:
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = enabled


def get_expert_parallel() -> bool:
    return _EXPERT_PARALLEL


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the group (in place when the group has more than one rank)."""
    if _TP_SIZE == 1:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _TP_SIZE == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    if _BACKEND == "nccl":
        out = torch.empty((_TP_SIZE * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=_TP_GROUP)
        if dim == 0:
            return out
        out = out.view(_TP_SIZE, *x.shape).movedim(0, dim)
        shape = list(x.shape)
        shape[dim] *= _TP_SIZE
        return out.reshape(shape)
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with tp rank `src`'s `x` (in place); returns x."""
    if _TP_SIZE == 1:
        return x
    assert x.is_contiguous(), "tp_broadcast needs a contiguous tensor"
    dist.broadcast(x, src=dist.get_global_rank(_TP_GROUP, src), group=_TP_GROUP)
    return x
