"""fp8 checkpoints for tests, as vLLM and llm-compressor write them: linear weights
float8_e4m3fn with a weight_scale per tensor (0-d) or per output channel ([N, 1])."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.quantization.cpu_fp8_linear import FP8_DTYPE, FP8_MAX
from tests.quantization.reference import LINEARS


def to_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, weight_scale) as an fp8 checkpoint stores them: a 0-d scale, or [N, 1]."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = amax.float() / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def from_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale


def write_fp8_checkpoint(
    src: str, dst: Path, per_channel: bool, static: bool, ignored: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Copy checkpoint `src` to `dst` with its linear weights (but `ignored`) stored fp8;
    returns each fp8 layer's dequantized weight by module name."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    dequantized = {}
    for name in list(tensors):
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in LINEARS or module in ignored:
            continue
        weight, scale = to_fp8(tensors[name].float(), per_channel)
        tensors[name], tensors[f"{module}.weight_scale"] = weight, scale
        if static:
            tensors[f"{module}.input_scale"] = torch.tensor([0.05])
        dequantized[module] = from_fp8(weight, scale)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static" if static else "dynamic",
        "ignored_layers": list(ignored),
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized
