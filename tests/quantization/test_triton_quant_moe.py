"""The fused block-quantized experts in Triton (models/quantization/triton_quant_moe.py; on
the GPU, or under TRITON_INTERPRET=1 without one) against a float64 reference on the
dequantized weights that runs each token through each of its experts: 4-bit blocks with
mins, int8 per block and per channel, fp8 with a scale per output feature, gate and up
reading x through a per-expert index (act-order), experts that get no token and ids of
other ranks (< 0).

The kernels round gate, up, silu(gate), their product and each slot's output to the dtype,
as the fused-MoE kernels do: the bound is tests/models/test_triton_moe.py's
(moe_reference.reference gives the magnitude) on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from models.quantization.cpu_fp8_linear import quantize_fp8_per_channel
from models.quantization.quant_moe import GatheredWeight, StackedQuantWeight, stack_gate_up
from models.quantization.triton_quant_linear import FP8_BITS
from models.quantization.triton_quant_moe import fused_quant_experts_triton, triton_quant_moe_takes
from tests.models.moe_reference import SMALL_TILES, reference, routing
from tests.quantization.kernel_cases import make_weight

HIDDEN, INTER, EXPERTS = 64, 32, 4


def _experts(bits: int, block: int | None, mins: bool, gathered: bool, seed: int):
    """(gate_up, down, w13, w2): random experts (gate and up fused, their input gathered by
    a per-expert permutation when `gathered`) and their dequantized float64 weights."""

    def weights(n: int, k: int, first: int) -> list:
        return [
            make_weight(n, k, bits, block or k, mins, torch.float16, seed * 100 + first + e)
            for e in range(EXPERTS)
        ]

    gate, up, down = (
        weights(INTER, HIDDEN, 0),
        weights(INTER, HIDDEN, 10),
        weights(HIDDEN, INTER, 20),
    )
    gen = torch.Generator().manual_seed(seed)
    index = [torch.randperm(HIDDEN, generator=gen) for _ in range(EXPERTS)]
    w13 = torch.zeros(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.float64)
    for e in range(EXPERTS):
        columns = index[e] if gathered else torch.arange(HIDDEN)
        w13[e][:INTER, columns] = gate[e].dequantize().double()
        w13[e][INTER:, columns] = up[e].dequantize().double()
    if gathered:
        gate, up = (
            [GatheredWeight(w, i) for w, i in zip(ws, index, strict=True)] for ws in (gate, up)
        )
    (gate_up,) = stack_gate_up(gate, up)
    w2 = torch.stack([w.dequantize().double() for w in down])
    return gate_up, StackedQuantWeight.stack(down), w13, w2


def _on(w: StackedQuantWeight, device: str) -> StackedQuantWeight:
    return w.to(torch.device(device))


@pytest.mark.parametrize(
    "bits, block, mins, gathered",
    [(4, 32, True, False), (8, 16, False, False), (8, None, False, False), (4, 32, False, True)],
    ids=["q4-mins", "int8-blocks", "int8-per-channel", "q4-gathered"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (9, 2), (33, 3)])
def test_matches_reference(kernel_device, bits, block, mins, gathered, dtype, num_tokens, top_k):
    seed = num_tokens * 10 + bits
    gate_up, down, w13, w2 = _experts(bits, block, mins, gathered, seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 0.1).to(dtype)  # gates of a few units
    weights, ids = routing(num_tokens, top_k, EXPERTS, seed)
    tiles = SMALL_TILES if num_tokens > 8 else None  # several K steps and column blocks
    out = fused_quant_experts_triton(
        x.to(kernel_device), _on(gate_up, kernel_device), _on(down, kernel_device),
        weights.to(kernel_device), ids.to(kernel_device), tiles,
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == x.shape
    expected, magnitude = reference(x, w13, w2, weights, ids)
    eps = torch.finfo(dtype).eps * (2 if dtype == torch.bfloat16 else 1)
    bound = eps * magnitude + 1e-5 * magnitude.max() + 1e-30
    error = (out.cpu().double() - expected).abs()
    assert (error <= bound).all(), f"{(error / bound).max():.2f} of the bound"
    assert out[(ids < 0).all(dim=1)].eq(0).all(), "a token of no local expert gets zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fp8_experts_match_reference(kernel_device, dtype, num_tokens):
    """fp8 experts (Fp8MoEMethod's stacked weights: a scale per output feature) as the
    launches read them: one block of K."""
    gen = torch.Generator().manual_seed(num_tokens)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    stacked, dense = [], []
    for w in (w13, w2):
        parts = [quantize_fp8_per_channel(e) for e in w]
        weight, scale = (
            torch.stack([p.weight for p in parts]),
            torch.stack([p.scale for p in parts]),
        )
        k = weight.shape[2]
        stacked.append(StackedQuantWeight(FP8_BITS, weight, scale.unsqueeze(-1), None, k))
        dense.append(weight.double() * scale.double()[..., None])
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    weights, ids = routing(num_tokens, 2, EXPERTS, num_tokens)
    tiles = SMALL_TILES if num_tokens > 8 else None
    on = [w.to(torch.device(kernel_device)) for w in stacked]
    out = fused_quant_experts_triton(
        x.to(kernel_device), *on, weights.to(kernel_device), ids.to(kernel_device), tiles
    )
    expected, magnitude = reference(x, *dense, weights, ids)
    eps = torch.finfo(dtype).eps * (2 if dtype == torch.bfloat16 else 1)
    bound = eps * magnitude + 1e-5 * magnitude.max() + 1e-30
    error = (out.cpu().double() - expected).abs()
    assert (error <= bound).all(), f"{(error / bound).max():.2f} of the bound"


def test_what_the_kernels_take(kernel_device):
    gate_up, down, _, _ = _experts(4, 32, True, False, 0)
    x = torch.randn(3, HIDDEN)
    assert triton_quant_moe_takes(x.cuda() if kernel_device == "cuda" else x, [gate_up], down) == (
        kernel_device == "cuda"
    )
    apart = [gate_up, gate_up]
    assert not triton_quant_moe_takes(x, apart, down)
    empty = fused_quant_experts_triton(x[:0], gate_up, down, torch.rand(0, 2), torch.zeros(0, 2))
    assert empty.shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="do not fit x"):
        fused_quant_experts_triton(x[:, :32], gate_up, down, torch.rand(3, 2), torch.zeros(3, 2))
