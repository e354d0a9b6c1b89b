"""--quantization int8: per-channel weight-only int8 quantized at load."""

import pytest
import torch

from models.quantization.int8 import quantize_per_channel_int8
from splitserve import LLM
from tests.integration.greedy import random_prompts
from tests.quantization.reference import check_greedy, dequantized_reference


def test_per_channel_quantization_round_trips_within_half_a_step():
    w = torch.randn(48, 64) * torch.rand(48, 1) * 3
    q = quantize_per_channel_int8(w)
    assert (q.bits, q.block_size, tuple(q.scales.shape), q.mins) == (8, 64, (48, 1), None)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert q.qweight.abs().max() == 127


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("checkpoint", ["llama", "qwen3"], indirect=True)
def test_int8_greedy_matches_transformers_on_the_dequantized_weights(checkpoint):
    reference = dequantized_reference(
        checkpoint, lambda name, w: quantize_per_channel_int8(w).dequantize()
    )
    llm = LLM(checkpoint, dtype="float32", quantization="int8", kv_cache_memory=2**24)
    assert llm.config.quantization == "int8"
    check_greedy(llm, reference, random_prompts(4, 3, 20))
