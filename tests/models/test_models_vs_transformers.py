"""Our models (no forward context: plain causal attention) against transformers, fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import load_model
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.mistral import MistralForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from tests.models.tiny import load_reference, make_tiny_checkpoint

PROMPT = torch.tensor([256, 5, 77, 3, 200, 287, 12, 12, 9, 41, 160, 7, 99, 1, 250, 30, 31, 2, 8])

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 50000.0}),
    "llama-bias-mha": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4},
    ),
    "llama-linear-rope-mqa": (
        "llama",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "num_key_value_heads": 1},
    ),
    "qwen2-yarn": ("qwen2", {"rope_scaling": YARN_ROPE, "rope_theta": 1e6}),
    "qwen2-linear-tied": (
        "qwen2",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "tie_word_embeddings": True},
    ),
    "qwen2-sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),
    "qwen3-head-dim-32": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # The prompt (19 tokens) is longer than the tiny mistral / gemma3 window (8).
    "mistral": ("mistral", {}),
    "mistral-full-head-dim-32-tied": (
        "mistral",
        {"sliding_window": None, "head_dim": 32, "tie_word_embeddings": True},
    ),
    "gemma3": ("gemma3", {}),
    "gemma3-softcap-linear-rope-mqa": (
        "gemma3",
        {
            "final_logit_softcapping": 2.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "rope_local_base_freq": 500.0,
            "num_key_value_heads": 1,
        },
    ),
    "gemma3-pattern-3-bias-untied": (
        "gemma3",
        {"sliding_window_pattern": 3, "attention_bias": True, "tie_word_embeddings": False},
    ),
    # Mixtures of experts: dense and sparse layers, top-k weights kept or renormalised, a
    # shared expert.
    "qwen3-moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3-moe-step-2-top-3-unnormalised": (
        "qwen3_moe",
        {"decoder_sparse_step": 2, "num_experts_per_tok": 3, "norm_topk_prob": False},
    ),
    "qwen2-moe": ("qwen2_moe", {}),
    "qwen2-moe-normalised-sparse-step-2": (
        "qwen2_moe",
        {"norm_topk_prob": True, "decoder_sparse_step": 2, "num_hidden_layers": 3},
    ),
    "mixtral": ("mixtral", {}),
    "mixtral-top-1-window-4": ("mixtral", {"num_experts_per_tok": 1, "sliding_window": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_logits_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    model = load_model(path, torch.float32)
    ref = load_reference(path)

    hidden = model(PROMPT, torch.arange(len(PROMPT)))
    assert hidden.shape == (len(PROMPT), ref.config.hidden_size)
    logits = model.compute_logits(hidden)
    expected = ref(PROMPT[None]).logits[0].float()
    assert logits.dtype == torch.float32
    assert logits.shape == (len(PROMPT), ref.config.vocab_size)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # Only the last rows, as the runner asks for them.
    torch.testing.assert_close(
        model.compute_logits(hidden[-2:]), expected[-2:], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize(
    ("arch", "overrides", "windows"),
    [
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
            [None, 3],
        ),
        ("mistral", {"sliding_window": 3}, [3, 3]),
        ("gemma3", {"sliding_window": 3}, [3, 3, 3, 3, 3, None]),
    ],
)
@torch.no_grad()
def test_sliding_window_layers_and_effect(tmp_path, arch, overrides, windows):
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    model = load_model(path, torch.float32)
    assert [layer.spec.sliding_window for layer in model.attention_layers()] == windows
    # The window changes the result for tokens past it (so the tests above mean something).
    full = model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))
    for layer in model.attention_layers():
        layer.spec = dataclasses.replace(layer.spec, sliding_window=None)
    no_window = model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))
    torch.testing.assert_close(full[:3], no_window[:3])
    assert (full[4:] - no_window[4:]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["mistral", "gemma3", "gemma3-softcap-linear-rope-mqa"])
@torch.no_grad()
def test_greedy_generate_matches_transformers(tmp_path, case):
    """Greedy tokens well past the window: ours recomputes the whole sequence each step,
    transformers' generate() decodes from its (sliding window) cache."""
    arch, overrides = CASES[case]
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    model = load_model(path, torch.float32)
    ref = load_reference(path)
    expected = ref.generate(
        PROMPT[None],
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
    )[0, len(PROMPT) :].tolist()
    ids = PROMPT.tolist()
    for _ in range(16):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    assert ids[len(PROMPT) :] == expected


@pytest.mark.parametrize(
    ("arch", "cls"),
    [
        ("llama", LlamaForCausalLM),
        ("qwen2", Qwen2ForCausalLM),
        ("qwen3", Qwen3ForCausalLM),
        ("mistral", MistralForCausalLM),
    ],
)
def test_model_structure(tmp_path, arch, cls):
    path = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=True)
    model = load_model(path, torch.float32)
    assert type(model) is cls
    layers = model.attention_layers()
    assert len(layers) == 2
    assert all(layer.spec.scale == 16**-0.5 for layer in layers)
    assert [layer.prefix for layer in layers] == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    assert all(layer.spec.num_heads == 4 and layer.spec.num_kv_heads == 2 for layer in layers)
    assert all(layer.spec.head_size == 16 and layer.kv_cache is None for layer in layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())
    has_bias = model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert has_bias == (arch == "qwen2")
    assert hasattr(model.model.layers[0].self_attn, "q_norm") == (arch == "qwen3")


def test_gemma3_structure(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "gemma3")
    model = load_model(path, torch.float32)
    assert type(model) is Gemma3ForCausalLM
    layers = model.attention_layers()
    assert [layer.prefix for layer in layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(6)
    ]
    assert [layer.spec.sliding_window for layer in layers] == [8, 8, 8, 8, 8, None]
    assert all(layer.spec.num_heads == 4 and layer.spec.num_kv_heads == 2 for layer in layers)
    assert all(layer.spec.head_size == 16 and layer.spec.scale == 24**-0.5 for layer in layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
@torch.no_grad()
def test_bfloat16_close_to_transformers(tmp_path, arch):
    """bf16 against transformers in bf16; for Gemma 3 with hidden_size 72, whose embedding
    scale sqrt(72) rounds in bf16 (8.485 -> 8.5), the scaled embedding is bitwise the same."""
    path = make_tiny_checkpoint(tmp_path, arch, hidden_size=72, num_attention_heads=4)
    model = load_model(path, torch.bfloat16)
    ref = load_reference(path).to(torch.bfloat16)
    if arch == "gemma3":
        seen = {}
        model.model.layers[0].input_layernorm.register_forward_pre_hook(
            lambda module, args: seen.update(embedding=args[0].clone())
        )
    logits = model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))
    expected = ref(PROMPT[None]).logits[0].float()
    if arch == "gemma3":
        assert torch.equal(seen["embedding"], ref.model.embed_tokens(PROMPT))
    assert (logits - expected).abs().max() < 0.5
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.8


def test_gemma3_unsupported_features_are_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "gemma3", attn_logit_softcapping=50.0)
    with pytest.raises(NotImplementedError, match="softcapping"):
        load_model(path, torch.float32)


@torch.no_grad()
def test_bfloat16_load_close_to_fp32(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    m32 = load_model(path, torch.float32)
    m16 = load_model(path, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    assert torch.get_default_dtype() == torch.float32
    pos = torch.arange(len(PROMPT))
    l32 = m32.compute_logits(m32(PROMPT, pos))
    l16 = m16.compute_logits(m16(PROMPT, pos))
    assert l16.dtype == torch.bfloat16  # the samplers read them in place
    assert (l16.float() - l32).abs().max() < 0.1
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean() > 0.8


def test_missing_and_unknown_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_path, "llama")
    tensors = load_file(f"{path}/model.safetensors")
    extra = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    save_file(extra, f"{path}/model.safetensors")
    load_model(path, torch.float32)  # rotary inv_freq is skipped

    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"gate_up_proj"):
        load_model(path, torch.float32)

    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(KeyError, match="mystery"):
        load_model(path, torch.float32)
