"""Checkpoint KV scales reach the attention layers (vLLM's names, and the older k/v
projection output scales), for an fp8 KV cache to divide by."""

import shutil

import torch
from safetensors.torch import save_file

from models.loader import load_model


def test_checkpoint_kv_scales_reach_the_attention_layers(tiny_checkpoint, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    save_file(
        {
            "model.layers.0.self_attn.attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.attn.v_scale": torch.tensor([0.25, 0.75]),
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(2.0),
        },
        str(folder / "kv_scales.safetensors"),
    )
    model = load_model(str(folder), torch.float32)
    specs = [attn.spec for attn in model.attention_layers()]
    assert (specs[0].k_scale, specs[0].v_scale) == (0.5, 0.75)
    assert (specs[1].k_scale, specs[1].v_scale) == (2.0, 1.0)
