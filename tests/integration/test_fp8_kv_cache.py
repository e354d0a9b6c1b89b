"""--kv-cache-dtype end to end on a tiny random Llama (bf16 on this CPU, the default
backend): the fp8 caches hold twice the blocks of the 16-bit one in the same memory, device
and host tier alike; the engine reports them in cache_config_info; and greedy decoding
with fp8 pages agrees with the 16-bit cache on most tokens.

What "most" means here: a random tiny model's logits are nearly flat, so a rounding flips
a greedy choice far more easily than in a trained model, and every token after a flip
differs, so a few prompts make a noisy measure. Measured on this model, 6 prompts: AMX CPU
e4m3 76 %, e5m2 60 % of the tokens (the torch backend: 85 %, 63 %); AMD Zen 3 (AVX2)
64 %, 74 %. With 48 prompts on the Zen 3: 72 %, 68 %. The test takes 48 prompts and asks
for at least 60 % and 50 % (broken pages agree on next to none)."""

import pytest
import torch

from splitserve import LLM
from tests.integration.greedy import generate_greedy, random_prompts

MEMORY = 8 << 20
HOST_MEMORY = 4 << 20
AGREEMENT = {"fp8": 0.6, "fp8_e5m2": 0.5}
PROMPTS = 48


@pytest.fixture(scope="module")
def runs(tiny_checkpoint) -> dict[str, tuple[list[list[int]], dict[str, str]]]:
    """Per --kv-cache-dtype: the greedy tokens of a few prompts and the cache_config_info
    labels of the engine's stats."""
    path = tiny_checkpoint("llama")
    prompts = random_prompts(PROMPTS, 5, 40)
    results = {}
    for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(
            path,
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=128,
            kv_cache_memory=MEMORY,
            kv_offload_memory=HOST_MEMORY,
        )
        try:
            outs = generate_greedy(llm, prompts, max_tokens=16)
            info = llm.engine.get_stats().cache_config_info
        finally:
            llm.engine.shutdown()
        results[kv_cache_dtype] = ([out.outputs[0].token_ids for out in outs], info)
    return results


def test_fp8_caches_hold_twice_the_blocks(runs):
    auto = runs["auto"][1]
    for kv_cache_dtype in ("fp8", "fp8_e5m2"):
        info = runs[kv_cache_dtype][1]
        assert info["cache_dtype"] == kv_cache_dtype and auto["cache_dtype"] == "auto"
        assert int(info["num_gpu_blocks"]) >= 1.9 * int(auto["num_gpu_blocks"])
        assert int(info["num_cpu_blocks"]) >= 1.9 * int(auto["num_cpu_blocks"]) > 0
        assert info["kv_cache_memory_bytes"] == str(MEMORY)


@pytest.mark.parametrize("kv_cache_dtype", sorted(AGREEMENT))
def test_greedy_tokens_agree_with_the_16_bit_cache(runs, kv_cache_dtype):
    expected, actual = runs["auto"][0], runs[kv_cache_dtype][0]
    tokens = torch.tensor(expected), torch.tensor(actual)  # [prompts, 16] each
    assert tokens[0].shape == tokens[1].shape == (PROMPTS, 16)
    agreement = (tokens[0] == tokens[1]).float().mean().item()
    assert agreement >= AGREEMENT[kv_cache_dtype], f"{agreement:.0%} of the tokens agree"
