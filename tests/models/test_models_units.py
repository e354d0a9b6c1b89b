"""Unit tests: registry, dtype resolution, KV shape info, rotary, sharding of the layers."""

from __future__ import annotations

import types

import pytest
import torch

import models.loader as loader
from models import get_model_class, kv_cache_shape_info, parallel_state, resolve_dtype
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding, pad_vocab_size
from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, compute_inv_freq


def test_registry():
    assert get_model_class(["LlamaForCausalLM"]).__name__ == "LlamaForCausalLM"
    assert get_model_class("Qwen2ForCausalLM").__name__ == "Qwen2ForCausalLM"
    assert get_model_class(["Foo", "Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError) as err:
        get_model_class(["GPT2LMHeadModel"])
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg
    assert get_model_class(["MistralForCausalLM"]).__name__ == "MistralForCausalLM"
    assert get_model_class(["Gemma3ForCausalLM"]).__name__ == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match="supported architectures"):
        get_model_class(None)


def _cfg(dtype):
    return types.SimpleNamespace(dtype=dtype)


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("float32", torch.float32),
        ("float", torch.float32),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_resolve_dtype_explicit(option, expected):
    assert resolve_dtype(option, _cfg("float32")) == expected


def test_resolve_dtype_auto(monkeypatch):
    monkeypatch.setattr(loader, "has_native_bf16", lambda: False)
    assert resolve_dtype("auto", _cfg("bfloat16")) == torch.float32  # bf16 weights, fp32 math
    assert resolve_dtype("auto", _cfg(torch.float16)) == torch.float32
    assert resolve_dtype("auto", _cfg("bfloat16"), "cuda") == torch.bfloat16
    assert resolve_dtype("auto", _cfg("float32")) == torch.float32
    assert resolve_dtype("auto", types.SimpleNamespace(torch_dtype="float32")) == torch.float32
    assert resolve_dtype("auto", types.SimpleNamespace()) == torch.float32
    monkeypatch.setattr(loader, "has_native_bf16", lambda: True)
    assert resolve_dtype("auto", _cfg("float32")) == torch.bfloat16
    assert resolve_dtype("auto", _cfg(torch.float32)) == torch.bfloat16
    assert resolve_dtype("auto", _cfg("float16")) == torch.float16
    assert resolve_dtype("float32", _cfg("float32")) == torch.float32


def test_resolve_dtype_errors():
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", _cfg("float32"))
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype(torch.int32, _cfg("float32"))
    with pytest.raises(ValueError, match="checkpoint dtype"):
        resolve_dtype("auto", _cfg("float8_e4m3fn"))


def test_cpu_bf16_detection_runs(monkeypatch):
    assert isinstance(loader.has_native_bf16(), bool)
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "generic")  # answers for a CPU of that ISA
    assert not loader.has_native_bf16()


def test_kv_cache_shape_info():
    cfg = types.SimpleNamespace(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        head_dim=None,
    )
    assert kv_cache_shape_info(cfg, 1) == (30, 3, 64)
    assert kv_cache_shape_info(cfg, 3) == (30, 1, 64)
    assert kv_cache_shape_info(cfg, 6) == (30, 1, 64)  # replicated kv heads
    with pytest.raises(ValueError):
        kv_cache_shape_info(cfg, 2)
    cfg.head_dim = 128
    cfg.num_key_value_heads = 8
    assert kv_cache_shape_info(cfg, 2) == (30, 4, 128)


def test_parallel_state_identities_without_group():
    assert parallel_state.get_tp_rank() == 0
    assert parallel_state.get_tp_size() == 1
    x = torch.randn(3, 4)
    assert parallel_state.tp_all_reduce(x) is x
    assert parallel_state.tp_all_gather(x, dim=0) is x
    assert parallel_state.tp_broadcast(x) is x
    parallel_state.init_distributed(0, 1, "tcp://127.0.0.1:1")  # world size 1: no dist
    assert not torch.distributed.is_initialized()
    assert parallel_state.get_tp_size() == 1
    parallel_state.destroy_distributed()


# --- rotary -----------------------------------------------------------------------------


ROPE_CASES = [
    ("llama", {}),
    ("llama", {"rope_theta": 500000.0}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 1e6}),
    (
        "qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            }
        },
    ),
    (
        "qwen3",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 256,
                "attention_factor": 0.9,
            },
            "head_dim": 32,
        },
    ),
]


@pytest.mark.parametrize(("arch", "overrides"), ROPE_CASES)
def test_inv_freq_matches_transformers(arch, overrides):
    import transformers

    from tests.models.tiny import _config

    config = _config(arch, dict(overrides))
    ref = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    inv_freq, scaling = compute_inv_freq(config)
    torch.testing.assert_close(inv_freq, ref.inv_freq.float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(ref.attention_scaling)
    # cos/sin as transformers computes them at the same positions
    rope = RotaryEmbedding.from_config(config)
    positions = torch.tensor([0, 1, 7, 63, 200, 511])
    x = torch.zeros(1, len(positions), 4)
    ref_cos, ref_sin = ref(x, positions[None])
    half = inv_freq.shape[0]
    cos, sin = rope.get_cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos[:, 0], ref_cos[0, :, :half], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], ref_sin[0, :, half:], rtol=1e-5, atol=1e-6)


def test_unsupported_rope_type():
    cfg = types.SimpleNamespace(
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4},
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    with pytest.raises(NotImplementedError, match="longrope"):
        compute_inv_freq(cfg)


def test_rms_norm_residual():
    norm = RMSNorm(8, eps=1e-6)
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, r)
    torch.testing.assert_close(new_residual, x + r)
    torch.testing.assert_close(out, norm(x + r))


# --- sharding (simulated ranks: only the weight loaders, no collectives) -----------------


@pytest.mark.parametrize(("tp", "kv"), [(2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_shards(fake_tp, tp, kv):
    heads, hd, hidden = 4, 3, 5
    q = torch.randn(heads * hd, hidden)
    k = torch.randn(kv * hd, hidden)
    v = torch.randn(kv * hd, hidden)
    for rank in range(tp):
        fake_tp(rank, tp)
        layer = QKVParallelLinear(hidden, hd, heads, kv, bias=False)
        for shard_id, w in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, w, shard_id)
        nh, nkv = heads // tp, max(1, kv // tp)
        assert (layer.num_heads, layer.num_kv_heads) == (nh, nkv)
        kv_head = rank * kv // tp  # the first kv head this rank holds
        expected = torch.cat(
            [
                q[rank * nh * hd : (rank + 1) * nh * hd],
                k[kv_head * hd : (kv_head + nkv) * hd],
                v[kv_head * hd : (kv_head + nkv) * hd],
            ]
        )
        torch.testing.assert_close(layer.weight.data, expected)
        # the query heads of this rank use the kv heads it holds (GQA grouping)
        group = heads // kv
        assert (rank * nh) // group == kv_head


def test_qkv_fused_checkpoint(fake_tp):
    fake_tp(1, 2)
    layer = QKVParallelLinear(6, 2, 4, 2, bias=True)
    fused = torch.randn((4 + 2 + 2) * 2, 6)
    layer.weight.weight_loader(layer.weight, fused)
    q, k, v = fused[:8], fused[8:12], fused[12:]
    torch.testing.assert_close(layer.weight.data, torch.cat([q[4:], k[2:], v[2:]]))


def test_merged_row_column_shards(fake_tp):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    down, down_bias = torch.randn(3, 8), torch.randn(3)
    col = torch.randn(6, 3)
    for rank in range(2):
        fake_tp(rank, 2)
        merged = MergedColumnParallelLinear(3, [8, 8], bias=False)
        merged.weight.weight_loader(merged.weight, gate, 0)
        merged.weight.weight_loader(merged.weight, up, 1)
        s = slice(rank * 4, rank * 4 + 4)
        torch.testing.assert_close(merged.weight.data, torch.cat([gate[s], up[s]]))
        row = RowParallelLinear(8, 3, bias=True)
        row.weight.weight_loader(row.weight, down)
        row.bias.weight_loader(row.bias, down_bias)
        torch.testing.assert_close(row.weight.data, down[:, s])
        torch.testing.assert_close(row.bias.data, down_bias)
        c = ColumnParallelLinear(3, 6, bias=False)
        c.weight.weight_loader(c.weight, col)
        torch.testing.assert_close(c.weight.data, col[rank * 3 : rank * 3 + 3])


def test_vocab_shards_with_padding(fake_tp):
    vocab, dim = 100, 4
    table = torch.randn(vocab, dim)
    assert pad_vocab_size(100, 2) == 128
    assert pad_vocab_size(100, 3) == 192
    rows = []
    for rank in range(3):
        fake_tp(rank, 3)
        emb = VocabParallelEmbedding(vocab, dim)
        emb.weight.weight_loader(emb.weight, table)
        assert emb.weight.shape == (64, dim)
        rows.append(emb.weight.data)
        head = ParallelLMHead(vocab, dim)
        head.tie_weights(emb)
        assert head.weight is emb.weight
    full = torch.cat(rows)
    torch.testing.assert_close(full[:vocab], table)
    assert full[vocab:].abs().sum() == 0


def test_lazy_safetensors_slices_load_only_the_shard(fake_tp, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.randn(8, 6)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    fake_tp(1, 2)
    row = RowParallelLinear(6, 8, bias=False)
    col = ColumnParallelLinear(6, 8, bias=False)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        row.weight.weight_loader(row.weight, f.get_slice("w"))
        col.weight.weight_loader(col.weight, f.get_slice("w"))
    torch.testing.assert_close(row.weight.data, w[:, 3:])
    torch.testing.assert_close(col.weight.data, w[4:])


def test_shape_mismatch_is_clear(fake_tp):
    layer = ColumnParallelLinear(3, 4, bias=False, prefix="x.proj")
    with pytest.raises(ValueError, match="shape mismatch loading x.proj"):
        layer.weight.weight_loader(layer.weight, torch.randn(4, 5))
    with pytest.raises(ValueError, match="not divisible"):
        fake_tp(0, 3)
        ColumnParallelLinear(3, 4)


def test_layer_sliding_windows():
    from models import layer_sliding_windows
    from tests.models.tiny import _config

    cfg = _config(
        "qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    )
    assert layer_sliding_windows(cfg) == [None, 8]
    assert layer_sliding_windows(_config("qwen3", {})) == [None, None]
    assert layer_sliding_windows(_config("llama", {})) == [None, None]
    old_style = types.SimpleNamespace(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=2
    )
    assert layer_sliding_windows(old_style) == [None, None, 4]


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_all_gather_nccl_layout(monkeypatch, dim):
    """The all_gather_into_tensor path (NCCL) concatenates along `dim` in rank order."""
    import torch.distributed as dist

    x = torch.arange(24.0).reshape(2, 3, 4)

    def fake_gather(out, inp, group=None):
        out.copy_(torch.cat([inp, inp + 100]))

    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    monkeypatch.setattr(parallel_state, "_BACKEND", "nccl")
    monkeypatch.setattr(dist, "all_gather_into_tensor", fake_gather)
    got = parallel_state.tp_all_gather(x, dim=dim)
    torch.testing.assert_close(got, torch.cat([x, x + 100], dim=dim))


def test_tiny_checkpoint_fixture(tiny_checkpoint):
    from transformers import AutoConfig, AutoTokenizer

    path = tiny_checkpoint("qwen3", num_key_value_heads=1)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.num_key_value_heads == 1
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("héllo", add_special_tokens=False)["input_ids"]
    assert ids == list("héllo".encode())
    assert tok.decode(ids) == "héllo"
    assert tok.eos_token_id == 258
