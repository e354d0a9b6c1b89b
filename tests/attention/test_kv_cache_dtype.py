"""--kv-cache-dtype and the per-layer KV scales: the names (vLLM's) and their refusals, the
checkpoint names a model routes to Attention.load_kv_scale, the backend choice (flash-attn
2 reads no fp8 pages)."""

import argparse

import pytest
import torch

from attention import Attention, get_attn_backend, kv_cache_torch_dtype, kv_scale_target
from attention.backends.triton_backend import TritonAttentionBackend
from attention.spec import AttentionSpec
from ipc.config import EngineConfig
from splitserve.engine_args import add_engine_args


def test_dtype_names_are_vllms():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8, "):
        kv_cache_torch_dtype("int8", torch.bfloat16)


def test_a_bad_kv_cache_dtype_is_refused_at_start(capsys):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*fp8_e5m2; got 'fp4'"):
        EngineConfig(max_model_len=64, kv_cache_dtype="fp4")
    assert EngineConfig(max_model_len=64, kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    parser = add_engine_args(argparse.ArgumentParser())
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp16"])
    assert "--kv-cache-dtype: invalid choice: 'fp16'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        AttentionSpec(4, 2, 8, 1.0, kv_cache_dtype="bf16")


def test_checkpoint_kv_scales_reach_their_layer():
    """vLLM's names and the older k_proj/v_proj output scales name the same layer."""
    layer = "model.layers.3.self_attn"
    assert kv_scale_target(f"{layer}.attn.k_scale") == (f"{layer}.attn", "k")
    assert kv_scale_target(f"{layer}.attn.v_scale") == (f"{layer}.attn", "v")
    assert kv_scale_target(f"{layer}.k_proj.output_scale") == (f"{layer}.attn", "k")
    assert kv_scale_target(f"{layer}.v_proj.output_scale") == (f"{layer}.attn", "v")
    assert kv_scale_target(f"{layer}.k_proj.weight") is None
    assert kv_scale_target(f"{layer}.q_proj.output_scale") is None
    attn = Attention(4, 8, 1.0, 2, prefix=f"{layer}.attn")
    assert (attn.spec.k_scale, attn.spec.v_scale) == (1.0, 1.0)
    attn.load_kv_scale("k", torch.tensor([0.1], dtype=torch.bfloat16))
    attn.load_kv_scale("v", torch.tensor([0.5, 3.0]))
    assert attn.spec.k_scale == float(torch.tensor(0.1, dtype=torch.bfloat16))
    assert attn.spec.v_scale == 3.0
    with pytest.raises(ValueError, match=rf"{layer}\.attn\.k_scale must be a positive finite"):
        attn.load_kv_scale("k", torch.tensor(0.0))
    with pytest.raises(ValueError, match="'k' or 'v'"):
        attn.load_kv_scale("q", 1.0)


def test_flash_attn_refuses_fp8_pages_and_auto_takes_triton():
    with pytest.raises(ValueError, match=r"flash_attn cannot read an fp8 KV cache \(--kv-cache"):
        get_attn_backend("flash_attn", "cuda", kv_cache_dtype="fp8")
    backend = get_attn_backend("auto", "cuda", block_size=256, kv_cache_dtype="fp8_e5m2")
    assert isinstance(backend, TritonAttentionBackend)
