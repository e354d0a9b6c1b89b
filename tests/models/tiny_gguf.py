"""Tiny random GGUF files for tests, written with gguf-py's GGUFWriter (no network).

    path, expected = write_tiny_gguf(tmp_path, "llama")   # or qwen2, qwen3, qwen3moe, qwen2moe

`expected` maps every HF parameter name to its float32 value in HF's layout, made
independently of the code under test: quantized tensors are drawn as raw blocks in HF
row order (real blocks of a random matrix for the types gguf-py quantizes) and
dequantized with gguf-py; a llama file's q/k rows are then permuted as llama.cpp's
converter does. The tokenizer is byte-level BPE with ChatML specials, as tests/models/tiny.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

BOS_ID, IM_START_ID, EOS_ID = 256, 257, 258
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, CONTEXT = 256, 512, 4, 2, 2, 512
HEAD_DIM = HIDDEN // HEADS
VOCAB = 260  # 256 bytes, 3 specials, one merge
_FLOAT16 = {"F16": torch.float16, "BF16": torch.bfloat16}

# GGUF name -> ggml type: every supported type, at each input width the model has.
DEFAULT_TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q5_1",
    "blk.0.attn_q.weight": "Q8_0",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "Q4_K",
    "blk.0.ffn_gate.weight": "Q5_K",
    "blk.0.ffn_up.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.attn_q.weight": "F16",  # every tensor not named here is F32
    "blk.1.attn_k.weight": "BF16",
    "blk.1.attn_v.weight": "Q5_0",
    "blk.1.attn_output.weight": "Q6_K",
    "blk.1.ffn_gate.weight": "Q8_0",
    "blk.1.ffn_up.weight": "Q4_1",
    "blk.1.ffn_down.weight": "Q5_K",
}
# Mixtures of experts (qwen3moe, qwen2moe): EXPERTS experts of EXPERT_FFN, top TOP_K, in
# two layers whose experts take different types (layer 1: gate and up apart).
EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 4, 2, 256, 256
MOE_TYPES = {
    "blk.0.ffn_gate_exps.weight": "Q4_K",
    "blk.0.ffn_up_exps.weight": "Q4_K",
    "blk.0.ffn_down_exps.weight": "Q6_K",
    "blk.1.ffn_gate_exps.weight": "Q8_0",
    "blk.1.ffn_up_exps.weight": "Q4_1",
    "blk.1.ffn_down_exps.weight": "Q5_K",
    "blk.0.ffn_gate_shexp.weight": "Q8_0",
    "blk.0.ffn_up_shexp.weight": "Q4_0",
    "blk.0.ffn_down_shexp.weight": "Q5_1",
}
_MOE_ARCHS = {"qwen3moe": "qwen3", "qwen2moe": "qwen2"}  # -> their attention's arch
_HF_LAYER = {
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
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # joined into gate_up_proj (_join_experts)
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_HF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE's alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _shapes(arch: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        layer = {
            "attn_norm.weight": (HIDDEN,),
            "attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            "ffn_norm.weight": (HIDDEN,),
            "ffn_gate.weight": (FFN, HIDDEN),
            "ffn_up.weight": (FFN, HIDDEN),
            "ffn_down.weight": (HIDDEN, FFN),
        }
        if arch in _MOE_ARCHS:
            del layer["ffn_gate.weight"], layer["ffn_up.weight"], layer["ffn_down.weight"]
            layer |= {
                "ffn_gate_inp.weight": (EXPERTS, HIDDEN),
                "ffn_gate_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_up_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_down_exps.weight": (EXPERTS, HIDDEN, EXPERT_FFN),
            }
        if arch == "qwen2moe":
            layer |= {
                "ffn_gate_inp_shexp.weight": (HIDDEN,),
                "ffn_gate_shexp.weight": (SHARED_FFN, HIDDEN),
                "ffn_up_shexp.weight": (SHARED_FFN, HIDDEN),
                "ffn_down_shexp.weight": (HIDDEN, SHARED_FFN),
            }
        attention = _MOE_ARCHS.get(arch, arch)
        if attention == "qwen2":
            layer |= {
                f"attn_{p}.bias": (n * HEAD_DIM,)
                for p, n in zip("qkv", (HEADS, KV_HEADS, KV_HEADS), strict=True)
            }
        if attention == "qwen3":
            layer |= {"attn_q_norm.weight": (HEAD_DIM,), "attn_k_norm.weight": (HEAD_DIM,)}
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_HF_LAYER[parts[2]]}.{parts[3]}"
    return f"{_HF_GLOBAL[parts[0]]}.{parts[1]}"


def _draw(ggml_type: str, shape: tuple[int, ...], rng: np.random.Generator):
    """(the array to write in HF row order, its float32 value)."""
    if ggml_type == "F32":
        value = rng.standard_normal(shape).astype(np.float32) * 0.1
        return value, value
    if ggml_type in _FLOAT16:
        value = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.1)
        value = value.to(_FLOAT16[ggml_type])
        raw = value.view(torch.int16).numpy().view(np.uint8).reshape(*shape[:-1], -1)
        return raw, value.float().numpy()
    if len(shape) == 3:  # stacked experts: each a matrix of the type
        drawn = [_draw(ggml_type, shape[1:], rng) for _ in range(shape[0])]
        return np.stack([r for r, _ in drawn]), np.stack([v for _, v in drawn])
    qtype = GGMLQuantizationType[ggml_type]
    n, k = shape
    if ggml_type in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raw = quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.1, qtype)
    else:
        elems, nbytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
        offsets = {"Q6_K": (208,), "Q2_K": (80, 82)}.get(ggml_type, (0, 2))
        for offset in offsets:
            scale = rng.uniform(-0.01, 0.01, (n, k // elems)).astype(np.float16)
            raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(n, k // elems, 2)
        raw = raw.reshape(n, -1)
    return raw, quants.dequantize(raw, qtype)


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows, for llama."""
    n = rows.shape[0]
    return (
        rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


def write_tiny_gguf(
    folder: Path,
    arch: str = "llama",
    types: dict[str, str] | None = None,
    seed: int = 0,
    eot_id: int | None = None,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random tiny `arch` model as folder/tiny-<arch>.gguf, and its expected HF tensors.
    `types` overrides DEFAULT_TYPES (tensors not named are F32); `eot_id` is written as
    tokenizer.ggml.eot_token_id."""
    rng = np.random.default_rng(seed)
    path = Path(folder) / f"tiny-{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([*byte_tokens(), "<|endoftext|>", "<|im_start|>", "<|im_end|>", "he"])
    writer.add_token_types([1] * 256 + [3, 3, 3, 1])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(BOS_ID)
    if eot_id is not None:
        writer.add_eot_token_id(eot_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    if arch in _MOE_ARCHS:
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(TOP_K)
        writer.add_expert_feed_forward_length(EXPERT_FFN)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(SHARED_FFN)
    types = {**DEFAULT_TYPES, **MOE_TYPES, **(types or {})}
    expected = {}
    for name, shape in _shapes(arch).items():
        ggml_type = types.get(name, "F32")
        raw, value = _draw(ggml_type, shape, rng)
        kind = name.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            raw = _llama_cpp_permute(raw, HEADS if kind == "attn_q" else KV_HEADS)
        qtype = None if ggml_type == "F32" else GGMLQuantizationType[ggml_type]
        writer.add_tensor(name, raw, raw_dtype=qtype)
        expected[_hf_name(name)] = torch.from_numpy(np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, _join_experts(expected)


def _join_experts(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names of the experts: gate_up_proj [E, 2 I, H], down_proj [E, H, I];
    the shared expert's gate [1, H]."""
    out = {}
    for name, value in expected.items():
        if name.endswith("experts.up_proj.weight"):
            continue
        if name.endswith("experts.gate_proj.weight"):
            up = expected[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj.weight", "gate_up_proj")] = torch.cat([value, up], dim=1)
        elif name.endswith("experts.down_proj.weight"):
            out[name.removesuffix(".weight")] = value
        elif name.endswith("shared_expert_gate.weight"):
            out[name] = value.unsqueeze(0)
        else:
            out[name] = value
    return out
