"""Tiny random Hugging Face checkpoints for tests (no network).

    from tests.models.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path, "qwen3", num_key_value_heads=1)

Every parameter is random (seeded), including norm weights and biases, so a wrong
or missing load shows up in the logits. Each checkpoint also gets a tiny byte-level
tokenizer with a ChatML chat template: ids 0-255 are the bytes, then
<|endoftext|> (256, bos/pad), <|im_start|> (257), <|im_end|> (258, eos).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

BOS_ID, IM_START_ID, EOS_ID = 256, 257, 258
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON: dict[str, Any] = {
    "vocab_size": 288,  # not a multiple of 64: exercises vocab padding under TP
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": BOS_ID,
}

_counter = itertools.count()


# arch -> (transformers config class name, architecture, config defaults of the arch).
_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    # Mixtures of experts: 8 (Mixtral 4) experts of intermediate 32, top 2.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Six layers: five local (window 8) then one global; tied embeddings as Gemma ships.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 6,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
        },
    ),
}


# The checkpoints tests share by name (the `checkpoint` and `tiny_checkpoint` fixtures of
# tests/conftest.py): name -> (arch, config overrides). The qwen2 hybrid has two window
# layers (window 8) before two full ones: two KV cache groups.
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen2-hybrid": (
        "qwen2",
        dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2),
    ),
    "mistral": ("mistral", {}),
    "gemma3": ("gemma3", {}),
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse.
    "qwen3-moe": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen2-moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
}


def _config(arch: str, overrides: dict[str, Any]) -> Any:
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}")
    class_name, architecture, defaults = _ARCHS[arch]
    kwargs = {**_COMMON, **defaults, **overrides}
    if (
        arch in ("qwen3", "qwen3_moe", "gemma3") and "head_dim" not in kwargs
    ):  # their default is not this
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    config = getattr(transformers, class_name)(**kwargs)
    config.architectures = [architecture]
    return config


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.08 * noise)


def make_tiny_tokenizer(path: str | Path) -> None:
    """Save a byte-level tokenizer (vocab 259) with a ChatML chat template to `path`."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # Order the 256 byte symbols by byte value so that id == byte.
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    for i, tok in enumerate(_SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _bytes_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def make_tiny_checkpoint(
    tmp_path: str | Path,
    arch: str = "llama",
    *,
    name: str | None = None,
    seed: int = 0,
    tokenizer: bool = True,
    **overrides: Any,
) -> str:
    """Save a random tiny `arch` ("llama" | "qwen2" | "qwen3" | "mistral" | "gemma3")
    checkpoint (float32 safetensors, plus a tokenizer) under tmp_path and return its folder.

    overrides go to the transformers config, e.g. tie_word_embeddings=True,
    num_key_value_heads=1, rope_scaling={"rope_type": "yarn", "factor": 4.0, ...},
    rope_theta=..., attention_bias=True, use_sliding_window=True, sliding_window=4.
    """
    import transformers

    config = _config(arch, overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path = Path(tmp_path) / (name or f"tiny-{arch}-{next(_counter)}")
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer:
        make_tiny_tokenizer(path)
    return str(path)


def load_reference(path: str) -> Any:
    """The transformers model for a checkpoint folder, float32, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def truncate_checkpoint(path: str, tmp_path: str | Path, num_layers: int) -> str:
    """A copy of the checkpoint at `path` with only its first num_layers layers (the
    embedding, final norm and head as they are): a draft model of the same tokenizer."""
    import transformers

    model = load_reference(path)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    out = Path(tmp_path) / f"{Path(path).name}-{num_layers}-layers"
    model.save_pretrained(str(out), safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(str(out))
    return str(out)
