"""The KV host tier end to end (fp32, tiny random checkpoints, real tensor copies between
two pools on the CPU): preemption by swap and by recompute give transformers' greedy
tokens, and prefix blocks evicted from the device come back from the host tier."""

import json
from pathlib import Path

import pytest

from ipc.utils import cdiv
from splitserve import LLM
from tests.integration.greedy import (
    generate_and_check,
    generate_greedy,
    random_prompts,
)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
CHUNK = 16

# tiny checkpoint -> each KV cache group's window
GROUP_WINDOWS = {"llama": [None], "qwen2-hybrid": [None, 8]}


pytestmark = pytest.mark.parametrize("model", sorted(GROUP_WINDOWS), indirect=True)


def _fewest_blocks(groups: list[int | None]) -> int:
    """The smallest device cache the scheduler accepts: one max_model_len request."""
    full = cdiv(MAX_MODEL_LEN, BLOCK_SIZE)
    return 1 + sum(full if w is None else cdiv(w - 1 + CHUNK, BLOCK_SIZE) + 1 for w in groups)


def _engine(model, num_host_blocks: int, **kw) -> LLM:
    """A device cache of the fewest blocks and a host tier of `num_host_blocks`."""
    config = json.loads((Path(model[0]) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    group_size = config["num_hidden_layers"] // len(model[1])  # equal groups here
    per_block = 2 * group_size * BLOCK_SIZE * config["num_key_value_heads"] * head_dim * 4
    return LLM(
        model[0],
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=CHUNK,
        num_gpu_blocks_override=_fewest_blocks(model[1]),
        kv_offload_memory=num_host_blocks * per_block,
        **kw,
    )


def _assert_both_tiers_empty(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    for pool in (kv.block_pool, kv.host_block_pool):
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
        assert all(block.ref_cnt == 0 for block in pool.blocks)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_by_swap_and_by_recompute(model, reference, mode):
    llm = _engine(model, num_host_blocks=64, preemption_mode=mode)
    assert llm.engine.kv_cache_manager.host_block_pool.num_blocks == 64
    prompts = random_prompts(6, 20, 40, seed=4)
    generate_and_check(llm, prompts, reference)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0
        assert stats.num_swapped_in_blocks >= stats.num_swapped_out_blocks
    else:
        assert stats.num_swapped_out_blocks == 0
    _assert_both_tiers_empty(llm)


def test_a_host_tier_too_small_falls_back_to_recompute(model, reference):
    llm = _engine(model, num_host_blocks=3, preemption_mode="swap")
    prompts = random_prompts(6, 20, 40, seed=4)
    generate_and_check(llm, prompts, reference)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_swapped_out_blocks == 0
    _assert_both_tiers_empty(llm)


def test_evicted_prefix_blocks_come_back_from_the_host_tier(model, reference):
    llm = _engine(model, num_host_blocks=128)
    shared = random_prompts(1, 40, 40, seed=2)[0]
    first = generate_greedy(llm, [shared + [1]])
    # Enough other prompts, one at a time, to evict every block of the shared prefix.
    for prompt in random_prompts(4, 40, 48, seed=3):
        generate_greedy(llm, [prompt])
    before = llm.engine.get_stats()
    again = generate_greedy(llm, [shared + [2]])
    stats = llm.engine.get_stats()
    assert stats.num_spilled_blocks > 0
    assert again[0].num_cached_tokens == 40
    assert stats.host_cache_hits - before.host_cache_hits == 40
    assert stats.num_swapped_in_blocks > before.num_swapped_in_blocks
    assert first[0].outputs[0].token_ids == reference(shared + [1])
    assert again[0].outputs[0].token_ids == reference(shared + [2])
    _assert_both_tiers_empty(llm)
