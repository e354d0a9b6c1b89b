"""The KV cache's dtype (`--kv-cache-dtype`) and the fp8 page format every backend shares:
a stored value is clamp(x / scale) cast to fp8 (round to nearest even), a read value is
fp8 * scale computed in float32, with one k_scale and one v_scale per layer."""

import torch

from ipc.config import KV_CACHE_DTYPES

FP8_KV_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for `--kv-cache-dtype name` ("auto": the model's)."""
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_DTYPES:
        choices = ", ".join(KV_CACHE_DTYPES)
        raise ValueError(f"--kv-cache-dtype must be one of {choices}; got {name!r}")
    return FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x stored as fp8 pages store it: x / scale in float32, clamped to the finite range
    (e4m3fn has no infinity: past it the cast gives NaN), rounded to nearest even."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_fp8(pages: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 pages read as `dtype`: fp8 * scale in float32."""
    return (pages.float() * scale).to(dtype)


def as_float32_scale(value: float, what: str) -> float:
    """A per-layer scale as the kernels use it (a positive, finite float32)."""
    scale = float(torch.tensor(value, dtype=torch.float32))
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"{what} must be a positive finite number, got {value}")
    return scale
