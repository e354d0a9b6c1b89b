"""Build a model from a Hugging Face folder and load its safetensors weights.

Weights are streamed with `safetensors.safe_open`: every tensor is handed to the model
as a lazy slice, and each parameter reads only its own tensor-parallel shard.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ipc.config import DTYPES, resolve_quantization
from kernels import KernelSet, has_native_bf16
from models.gguf_file import gguf_config, is_gguf, iterate_gguf
from models.layers.cpu_linear import dense_linear_kernel
from models.layers.embedding import VocabParallelEmbedding
from models.layers.linear import LinearBase, UnquantizedLinearMethod, kv_heads_per_rank
from models.layers.rotary import get_head_dim
from models.llama import LlamaForCausalLM
from models.quantization import building_with, get_quantization_config
from models.registry import get_model_class

# Every name in ipc.config.DTYPES but "auto" is a torch attribute ("float" and "half"
# are aliases of float32 and float16).
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


def _config_dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"checkpoint dtype {value!r} is not supported")
    return _DTYPES[name]


def resolve_dtype(
    dtype: str | torch.dtype, config: Any, device: torch.device | str = "cpu"
) -> torch.dtype:
    """The compute dtype for a --dtype option.

    "auto" is the checkpoint's dtype (config.dtype / config.torch_dtype, float32 if
    absent), except that a float32 checkpoint runs in bfloat16 on a CPU with native
    bf16, and in bfloat16 (float16 without bf16 support) on CUDA, and that any checkpoint
    runs in float32 on a CPU without native bf16 (its dense weights held in bfloat16:
    dense_weight_dtype).
    "float32"/"float", "float16"/"half", "bfloat16" name a dtype directly.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        resolved = _config_dtype(config)
        device_type = torch.device(device).type
        if device_type == "cpu" and not has_native_bf16():
            return torch.float32
        if resolved == torch.float32:
            if device_type == "cpu":
                return torch.bfloat16
            if device_type == "cuda":
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return resolved
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return _DTYPES[name]


def dense_weight_dtype(
    option: str | torch.dtype, dtype: torch.dtype, device: torch.device | str, kernels: KernelSet
) -> torch.dtype:
    """The dtype a model computing in `dtype` holds its dense linear and embedding weights
    in: `dtype`, except that `--dtype auto` resolved to float32 on a CPU whose kernels lack
    bf16 instructions holds them in bfloat16 (half the bytes a decode step reads), computed
    on in float32 by the dense kernel (models/layers/cpu_linear.py). Its output then is
    that of the checkpoint's weights rounded to bf16, as on CPUs that compute in bf16."""
    auto = isinstance(option, str) and option.strip().lower() == "auto"
    cpu = torch.device(device).type == "cpu" and kernels.cpu
    bf16_cpu = kernels.has("avx512_bf16")
    if auto and cpu and dtype == torch.float32 and not bf16_cpu and dense_linear_kernel(kernels):
        return torch.bfloat16
    return dtype


def hold_dense_weights_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the weights of the model's unquantized linear and embedding layers to `dtype`
    (a tied LM head shares its embedding's Parameter); they compute in the model's dtype."""
    for module in model.modules():
        dense_linear = isinstance(module, LinearBase) and isinstance(
            module.quant_method, UnquantizedLinearMethod
        )
        dense_table = isinstance(module, VocabParallelEmbedding) and module.quant_method is None
        if dense_linear or dense_table:
            module.weight.data = module.weight.data.to(dtype)


def kv_cache_shape_info(config: Any, tp_size: int = 1) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads_per_rank, head_dim) to size one rank's KV cache."""
    total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    num_kv_per_rank, _ = kv_heads_per_rank(total_kv, tp_size)
    return config.num_hidden_layers, num_kv_per_rank, get_head_dim(config)


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None = full attention), as the model will build it.
    A config without `architectures` is read with the Llama/Qwen2 rule."""
    architectures = getattr(config, "architectures", None)
    model_cls = get_model_class(architectures) if architectures else LlamaForCausalLM
    return model_cls.layer_sliding_windows(config)


def safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_path}")
    return files


def iterate_safetensors(model_path: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor; a slice reads from disk only what is indexed."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(name)
                yield name, (f.get_tensor(name) if len(sl.get_shape()) == 0 else sl)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_config(model_path: str) -> Any:
    """The transformers config of a model folder or a .gguf file (from its metadata)."""
    if is_gguf(model_path):
        return gguf_config(model_path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def load_model(
    model_path: str,
    dtype: torch.dtype | str,
    device: torch.device | str = "cpu",
    config: Any = None,
    kernels: KernelSet | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """Build the model for `model_path` on `device` in `dtype`, load this tensor-parallel
    rank's shard of the weights, quantized as `quantization` says (a --quantization
    value; None: as the checkpoint is), and hand its layers the kernel set (default: the
    set of a model on `device`, KernelSet.for_device). Initialise models.parallel_state
    first for TP > 1."""
    if config is None:
        config = load_config(model_path)
    option, kernels = dtype, kernels or KernelSet.for_device(device)
    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(dtype, config, device)
    model_cls = get_model_class(getattr(config, "architectures", None))
    device = torch.device(device)
    method = resolve_quantization(model_path, quantization)
    quant_config = get_quantization_config(method, config)
    if quant_config is not None:
        quant_config.check_dtype(dtype)
    with _default_dtype(dtype), device, building_with(quant_config):
        model = model_cls(config)
    weights = iterate_gguf(model_path) if is_gguf(model_path) else iterate_safetensors(model_path)
    loaded = model.load_weights(weights)
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_path} has no weights for {missing}")
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    weight_dtype = dense_weight_dtype(option, dtype, device, kernels)
    if weight_dtype != dtype:
        hold_dense_weights_in(model, weight_dtype)
    bind_kernels(model, kernels)
    return model.eval()


def bind_kernels(model: nn.Module, kernels: KernelSet) -> None:
    """Hand the kernel set to every layer that runs kernels (those with `bind_kernels`):
    each takes its kernels from it once (a linear layer packs its weight for them). Bind
    again after changing weights."""
    for module in model.modules():
        bind = getattr(module, "bind_kernels", None)
        if bind is not None:
            bind(kernels)
