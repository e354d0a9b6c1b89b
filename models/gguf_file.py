"""A GGUF file (llama.cpp's format) as a model: its config and its tensors by HF name.

The tensors are memory-mapped: a quantized one is a `GGUFWeight` over its raw blocks,
an F32/F16/BF16 one a plain tensor. llama.cpp's converter permutes the rows of a llama
model's q_proj and k_proj (each head's two rotary halves interleaved); `iterate_gguf`
puts them back, moving whole rows, so quantized blocks are untouched.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.quantization.gguf_types import GGUFWeight

# general.architecture / transformers' model_type -> config.architectures
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, the experts stacked [E, N, K], Qwen2-MoE's shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# transformers' config fields the GGUF metadata of a mixture of experts sets, which its own
# GGUF reader leaves at their defaults; llama.cpp renormalises Qwen3-MoE's top-k weights.
_MOE_METADATA = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_MOE_DEFAULTS = {"qwen3_moe": {"norm_topk_prob": True}, "qwen2_moe": {"norm_topk_prob": False}}
# Tensors the models do not load: llama3's rope frequency factors are in the config.
_SKIPPED = {"rope_freqs"}
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf")


def gguf_config(path: str | os.PathLike) -> Any:
    """The transformers config of the file's metadata, with `architectures` set."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if config.model_type not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path} holds a {config.model_type} model; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    config.architectures = [ARCHITECTURES[config.model_type]]
    metadata, _ = read_gguf(path)
    arch = metadata.get("general.architecture")
    if config.model_type not in ("llama", "mistral"):
        # transformers takes head_dim from the metadata for these only (others: its default)
        head_dim = metadata.get(f"{arch}.attention.key_length")
        if head_dim is not None:
            config.head_dim = head_dim
    if metadata.get(f"{arch}.expert_count") and not hasattr(config, "num_experts"):
        raise ValueError(
            f"GGUF file {path} holds a {arch} mixture of experts, which is not supported "
            "(GGUF mixtures of experts: qwen2moe, qwen3moe)"
        )
    for key, field in _MOE_METADATA.items():
        value = metadata.get(f"{arch}.{key}")
        if value is not None:
            setattr(config, field, value)
    for field, value in _MOE_DEFAULTS.get(config.model_type, {}).items():
        setattr(config, field, value)
    return config


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor name; None for a tensor models do not load."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _SKIPPED:
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    match = _LAYER.fullmatch(gguf_name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    raise ValueError(f"GGUF tensor {gguf_name} has no Hugging Face name this loader knows")


def iterate_gguf(path: str | os.PathLike) -> Iterator[tuple[str, GGUFWeight | torch.Tensor]]:
    """(HF name, tensor) for every tensor the model loads, memory-mapped (q_proj/k_proj
    rows of a llama file are copied in HF's order)."""
    metadata, tensors = read_gguf(path)
    heads = _rotary_heads(metadata)
    for tensor in tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        value = _tensor(tensor, name)
        kind = tensor.name.split(".")[-2]
        if kind == "ffn_gate_inp_shexp" and value.dim() == 1:  # llama.cpp stores it as [H]
            value = value.unsqueeze(0)
        if kind in heads:
            value = _unpermute_rows(value, heads[kind])
        yield name, value


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor of a GGUF file: its ggml type's name, its shape (outermost first, as torch
    orders it) and its bytes, memory-mapped."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


# GGUF's value types: struct formats of the scalars, the string and the array.
_SCALARS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """A GGUF file's scalar and string metadata (arrays left out) and its tensors. gguf's
    GGUFReader makes a numpy view of every value of every array, the vocabulary's 49,152
    tokens and 48,900 merges among them: ~3 s of each start on SmolLM2's file. The file is
    mapped copy-on-write (writable arrays without copies)."""
    file = np.memmap(path, np.uint8, "c")
    offset = 0

    def read(fmt: str) -> Any:
        nonlocal offset
        values = struct.unpack_from("<" + fmt, file, offset)
        offset += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal offset
        size = read("Q")
        offset += size
        return bytes(file[offset - size : offset]).decode("utf-8", "replace")

    def value(kind: int) -> Any:
        nonlocal offset
        if kind in _SCALARS:
            return read(_SCALARS[kind])
        if kind == _STRING:
            return string()
        if kind != _ARRAY:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        item, count = read("IQ")
        if item in _SCALARS:
            offset += count * struct.calcsize("<" + _SCALARS[item])
        elif item == _STRING:  # skipped, not decoded
            for _ in range(count):
                size = read("Q")
                offset += size
        else:
            for _ in range(count):
                value(item)
        return None

    magic, version, n_tensors, n_kv = read("4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
    metadata = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(read("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        n_dims = read("I")
        dims = struct.unpack_from(f"<{n_dims}Q", file, offset)
        offset += 8 * n_dims
        infos.append((name, dims, *read("IQ")))
    alignment = metadata.get("general.alignment") or 32
    data = offset + (-offset) % alignment
    tensors = []
    for name, dims, ggml_type, start in infos:
        kind = GGMLQuantizationType(ggml_type)
        block, size = GGML_QUANT_SIZES[kind]
        end = data + start + math.prod(dims) // block * size
        shape = tuple(int(d) for d in reversed(dims))  # ggml lists K first
        tensors.append(GGUFTensor(name, kind.name, shape, np.asarray(file[data + start : end])))
    return metadata, tensors


def _tensor(tensor: GGUFTensor, name: str) -> GGUFWeight | torch.Tensor:
    raw = torch.from_numpy(tensor.data)
    if tensor.type_name in _PLAIN:
        return raw.view(_PLAIN[tensor.type_name]).reshape(tensor.shape)
    k = tensor.shape[-1]
    rows = math.prod(tensor.shape) // k
    return GGUFWeight(tensor.type_name, raw.reshape(rows, -1), (rows, k), name)


def _rotary_heads(metadata: dict[str, Any]) -> dict[str, int]:
    """{"attn_q": heads, "attn_k": kv heads} of a llama file (llama.cpp permuted their
    rows), else {}."""
    if metadata.get("general.architecture") != "llama":
        return {}
    heads = metadata["llama.attention.head_count"]
    kv_heads = metadata.get("llama.attention.head_count_kv", heads)
    return {"attn_q": heads, "attn_k": kv_heads}


def _unpermute_rows(value: GGUFWeight | torch.Tensor, heads: int) -> GGUFWeight | torch.Tensor:
    """Rows in HF's order: llama.cpp stores row (h, j, i) of the [heads, 2, half] view
    at (h, i, j) of [heads, half, 2]."""
    rows = value.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(value, GGUFWeight):
        return GGUFWeight(value.ggml_type, value.data[order], value.shape, value.name)
    return value[order]
