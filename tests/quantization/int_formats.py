"""The AWQ / GPTQ / compressed-tensors variants the tests run: each quantizes a float
weight with the test packers and names its quantization_config."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from tests.quantization.int_packers import (
    awq_tensors,
    compressed_tensors,
    gptq_tensors,
    group_ids,
    rtn,
)

# Projections quantized with one act-order permutation (they share their input).
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up"}
_SHARED_INPUT["up_proj"] = "gate_up"


@dataclass(frozen=True)
class IntFormat:
    method: str  # awq | gptq | compressed-tensors
    bits: int = 4
    group: int = 128  # -1: one group per output channel
    sym: bool = False
    desc_act: bool = False

    def __str__(self) -> str:
        order = "-act" if self.desc_act else ""
        return f"{self.method}-w{self.bits}-g{self.group}-{'sym' if self.sym else 'asym'}{order}"

    def config(self) -> dict:
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": 4,
                "group_size": self.group,
                "zero_point": True,
                "version": "gemm",
            }
        if self.method == "gptq":
            return {
                "quant_method": "gptq",
                "bits": self.bits,
                "group_size": self.group,
                "desc_act": self.desc_act,
                "sym": self.sym,
                "checkpoint_format": "gptq",
            }
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.sym,
            "strategy": "channel" if self.group == -1 else "group",
            "group_size": None if self.group == -1 else self.group,
            "actorder": "group" if self.desc_act else None,
        }
        group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }

    def quantize(self, name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the checkpoint tensors of linear layer `name`, its dequantized weight)."""
        k = w.shape[1]
        group = k if self.group == -1 else self.group
        perm = None
        if self.desc_act:
            parent, _, leaf = name.rpartition(".")
            seed = zlib.crc32(f"{parent}.{_SHARED_INPUT.get(leaf, leaf)}".encode())
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        scale_dtype = torch.bfloat16 if self.method == "compressed-tensors" else torch.float16
        qw = rtn(w, self.bits, group_ids(k, group, perm), self.sym, scale_dtype)
        if self.method == "awq":
            tensors = awq_tensors(qw)
        elif self.method == "gptq":
            tensors = gptq_tensors(qw)
        else:
            tensors = compressed_tensors(qw, self.sym, self.desc_act)
        return tensors, qw.dequantize()
