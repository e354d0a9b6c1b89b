"""MoE pieces: the router's top-k against its definition, and a checkpoint with the experts
stacked (transformers' in-memory layout) loading as the per-expert one does."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import load_model
from models.layers.fused_moe import route
from tests.models.tiny import make_tiny_checkpoint

PROMPT = torch.tensor([256, 5, 77, 3, 200, 287, 12, 12, 9, 41, 160, 7, 99, 1, 250, 30])


def test_route_takes_the_top_k_of_the_softmax_and_renormalises_on_request():
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for renormalize in (False, True):
        weights, ids = route(logits.to(torch.bfloat16), 3, renormalize)
        probs = logits.to(torch.bfloat16).float().softmax(-1)
        for t in range(7):
            expected = sorted(range(8), key=lambda e: -probs[t, e].item())[:3]
            assert ids[t].tolist() == expected
            want = probs[t, expected]
            if renormalize:
                want = want / want.sum()
            torch.testing.assert_close(weights[t], want)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64


def _stack_experts(src: str, dst: Path) -> None:
    """The checkpoint at src with each layer's experts as gate_up_proj [E, 2I, H] (gate rows
    first) and down_proj [E, H, I]."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    pattern = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in list(tensors):
        if match := pattern.match(name):
            module, expert, proj = match.groups()
            experts.setdefault(module, {}).setdefault(int(expert), {})[proj] = tensors.pop(name)
    for module, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        tensors[f"{module}.gate_up_proj"] = torch.stack(
            [torch.cat([p["gate"], p["up"]]) for p in ordered]
        )
        tensors[f"{module}.down_proj"] = torch.stack([p["down"] for p in ordered])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@torch.no_grad()
def test_stacked_experts_load_as_per_expert_ones(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe", name="per-expert")
    _stack_experts(path, tmp_path / "stacked")
    positions = torch.arange(len(PROMPT))
    expected = load_model(path, torch.float32)
    got = load_model(str(tmp_path / "stacked"), torch.float32)
    torch.testing.assert_close(
        got.compute_logits(got(PROMPT, positions)),
        expected.compute_logits(expected(PROMPT, positions)),
    )


def test_a_method_without_a_moe_method_is_refused_naming_the_layer():
    from models.layers.fused_moe import FusedMoE
    from models.quantization import building_with
    from models.quantization.base_config import QuantizationConfig

    class LinearsOnly(QuantizationConfig):
        name = "linears-only"

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            return None

    with (
        building_with(LinearsOnly()),
        pytest.raises(
            ValueError, match=r"layers\.0\.mlp\.experts: experts quantized with 'linears-only'"
        ),
    ):
        FusedMoE(8, 2, 64, 32, renormalize=True, prefix="layers.0.mlp.experts")
