"""Choosing the attention backend (`--attention-backend auto|flash_attn|triton|torch`)."""

import torch

from attention.backends.base import AttentionBackend
from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.flash_attn_backend import FlashAttentionBackend
from attention.backends.torch_backend import TorchAttentionBackend
from attention.backends.triton_backend import TritonAttentionBackend
from ipc.config import ATTENTION_BACKENDS as BACKEND_NAMES
from kernels import KernelSet


def get_attn_backend(
    name: str = "auto",
    device: torch.device | str = "cpu",
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    kernels: KernelSet | None = None,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """A backend instance for this device. "auto": flash_attn on CUDA when it is
    installed and supports block_size, dtype (when given) and the KV cache dtype (flash-attn
    2 reads no fp8 pages), else triton on CUDA;
    on CPU the C++ kernels (cpu), or torch where the kernel set has them off or they cannot
    be built. The CUDA backends store K/V with Triton where the set has Triton on.
    `kernels` defaults to the set of a model on `device` (KernelSet.for_device)."""
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    on_cuda = torch.device(device).type == "cuda"
    kernels = kernels or KernelSet.for_device(device)
    if name == "auto":
        if not on_cuda:
            module = load_cpu_attention(kernels)
            return CPUAttentionBackend(module) if module else TorchAttentionBackend()
        if FlashAttentionBackend.supports(block_size, dtype) and kv_cache_dtype == "auto":
            try:
                return FlashAttentionBackend(triton_store=kernels.triton)
            except ImportError:
                pass
        return TritonAttentionBackend(triton_store=kernels.triton)
    if name == "flash_attn":
        if not on_cuda:
            raise ValueError("attention backend flash_attn needs a CUDA device")
        if kv_cache_dtype != "auto":
            raise ValueError(
                f"attention backend flash_attn cannot read an fp8 KV cache (--kv-cache-dtype "
                f"{kv_cache_dtype}): flash-attn 2 takes fp16/bf16 pages only; use "
                "--attention-backend triton, or --kv-cache-dtype auto"
            )
        if not FlashAttentionBackend.supports(block_size, dtype):
            raise ValueError(
                "attention backend flash_attn needs a block size that is a multiple of "
                f"{FlashAttentionBackend.block_size_multiple} and fp16/bf16, got "
                f"block_size={block_size}, dtype={dtype}"
            )
        try:
            return FlashAttentionBackend(triton_store=kernels.triton)
        except ImportError as e:
            raise ImportError("attention backend flash_attn needs `pip install flash-attn`") from e
    if name == "triton":
        if not on_cuda:
            raise ValueError("attention backend triton needs a CUDA device")
        return TritonAttentionBackend(triton_store=kernels.triton)
    if name == "cpu":
        if on_cuda:
            raise ValueError("attention backend cpu runs on CPU devices only")
        module = load_cpu_attention(kernels)
        if module is None:
            raise RuntimeError(
                "attention backend cpu: its C++ kernels are off (SPLITSERVE_CPU_KERNELS=0) "
                "or could not be built"
            )
        return CPUAttentionBackend(module)
    return TorchAttentionBackend()
