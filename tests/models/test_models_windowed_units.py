"""Units of the Mistral and Gemma 3 families: each layer's sliding window (what the KV
cache groups are built from), Gemma 3's per-layer-type rotary embedding, and Gemma's
RMSNorm and gelu-tanh MLP activation, against transformers."""

from __future__ import annotations

import types

import pytest
import torch

from kernels import KernelSet
from models import layer_sliding_windows, load_config
from models.layers.activation import GeluTanhAndMul, get_act_and_mul
from models.layers.norm import GemmaRMSNorm
from models.layers.rotary import RotaryEmbedding, compute_inv_freq
from tests.models.tiny import _config, make_tiny_checkpoint


def test_mistral_windows_every_layer():
    assert layer_sliding_windows(_config("mistral", {"sliding_window": 8})) == [8, 8]
    assert layer_sliding_windows(_config("mistral", {"sliding_window": None})) == [None, None]
    four = _config("mistral", {"sliding_window": 5, "num_hidden_layers": 4})
    assert layer_sliding_windows(four) == [5, 5, 5, 5]


def test_gemma3_windows_follow_the_layer_pattern(tmp_path):
    config = _config("gemma3", {"sliding_window": 4, "num_hidden_layers": 7})
    assert layer_sliding_windows(config) == [4, 4, 4, 4, 4, None, 4]
    pattern_3 = _config("gemma3", {"sliding_window_pattern": 3, "num_hidden_layers": 7})
    assert layer_sliding_windows(pattern_3) == [8, 8, None, 8, 8, None, 8]
    explicit = ["full_attention", "sliding_attention", "full_attention"]
    config = _config("gemma3", {"layer_types": explicit, "num_hidden_layers": 3})
    assert layer_sliding_windows(config) == [None, 8, None]
    # As a saved checkpoint's config is read back.
    path = make_tiny_checkpoint(tmp_path, "gemma3", tokenizer=False)
    assert layer_sliding_windows(load_config(path)) == [8, 8, 8, 8, 8, None]


def test_gemma3_windows_from_an_old_style_config():
    """transformers 4 configs carry sliding_window_pattern and no layer_types."""
    old_style = types.SimpleNamespace(
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=8,
        sliding_window=16,
        sliding_window_pattern=4,
    )
    assert layer_sliding_windows(old_style) == [16, 16, 16, None, 16, 16, 16, None]
    del old_style.sliding_window_pattern  # transformers' default pattern: 6
    assert layer_sliding_windows(old_style) == [16] * 5 + [None] + [16] * 2


ROPE_CASES = {
    "default": {},
    "linear-global": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "bases": {"rope_theta": 5e4, "rope_local_base_freq": 300.0},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_gemma3_rope_per_layer_type_matches_transformers(case):
    import transformers

    config = _config("gemma3", dict(ROPE_CASES[case]))
    ref = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    positions = torch.tensor([[0, 1, 9, 100, 511]])
    for layer_type in ("sliding_attention", "full_attention"):
        inv_freq, scaling = compute_inv_freq(config, layer_type)
        torch.testing.assert_close(inv_freq, getattr(ref, f"{layer_type}_inv_freq"))
        assert scaling == getattr(ref, f"{layer_type}_attention_scaling")
        rope = RotaryEmbedding.from_config(config, layer_type)
        ref_cos, ref_sin = ref(torch.zeros(1), positions, layer_type)
        cos, sin = rope.get_cos_sin(positions[0], torch.float32)
        torch.testing.assert_close(cos[:, 0], ref_cos[0, :, :8], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sin[:, 0], ref_sin[0, :, :8], rtol=1e-5, atol=1e-6)
    local, _ = compute_inv_freq(config, "sliding_attention")
    assert not torch.equal(local, compute_inv_freq(config, "full_attention")[0])


def test_gemma3_rope_from_an_old_style_config():
    """transformers 4: rope_theta and rope_scaling are the global layers', local layers
    use plain rope at rope_local_base_freq."""
    kwargs = {"rope_theta": 5e4, "rope_local_base_freq": 300.0}
    scaling = {"rope_type": "linear", "factor": 8.0}
    config = _config("gemma3", {**kwargs, "rope_scaling": dict(scaling)})
    old_style = types.SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=512,
        rope_scaling=scaling,
        **kwargs,
    )
    for layer_type in ("sliding_attention", "full_attention"):
        expected, _ = compute_inv_freq(config, layer_type)
        torch.testing.assert_close(compute_inv_freq(old_style, layer_type)[0], expected)


@pytest.mark.parametrize("cpu_kernels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_is_transformers_bitwise(dtype, cpu_kernels):
    """With the fused kernels bound too: they compute Llama's norm, not Gemma's."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, generator=gen)
    ref = Gemma3RMSNorm(48, eps=1e-6)
    ref.weight.data.copy_(weight)
    norm = GemmaRMSNorm(48, eps=1e-6)
    norm.weight.data.copy_(weight)
    norm.weight.data = norm.weight.data.to(dtype)
    norm.bind_kernels(KernelSet(cpu=cpu_kernels))
    ref.weight.data = ref.weight.data.to(dtype)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), ref(x))
        out, total = norm(x, residual)
        assert torch.equal(total, residual + x)
        assert torch.equal(out, ref(residual + x))
    assert torch.equal(GemmaRMSNorm(4).weight, torch.zeros(4))  # 1 + 0: identity scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_is_transformers_bitwise(dtype):
    from transformers.activations import ACT2FN

    x = torch.randn(7, 2 * 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    act = get_act_and_mul("gelu_pytorch_tanh")
    assert isinstance(act, GeluTanhAndMul)
    expected = ACT2FN["gelu_pytorch_tanh"](x[:, :24]) * x[:, 24:]
    assert torch.equal(act(x), expected)
    with pytest.raises(ValueError, match="gelu_pytorch_tanh"):
        get_act_and_mul("relu")
