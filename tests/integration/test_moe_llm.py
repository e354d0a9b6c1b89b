"""Mixture-of-experts models (tiny random Qwen3-MoE with a dense layer, Qwen2-MoE with its
shared expert, Mixtral) in the engine against transformers' greedy tokens, float32:
chunked prefill with prefix hits in one process, then two worker processes over gloo,
tensor parallel (every expert sliced) and expert parallel (whole experts per rank)."""

import pytest

from models.layers.fused_moe import FusedMoE
from tests.integration.greedy import (
    check_prefix_hits,
    float32_engine,
    generate_and_check,
    greedy_reference,
    random_prompts,
)

MODELS = ["qwen3-moe", "qwen2-moe", "mixtral"]
# Two worker processes each: Qwen3-MoE in the default set, the others marked slow.
TWO_RANKS = [
    pytest.param(name, ep, marks=[] if name == "qwen3-moe" else [pytest.mark.slow])
    for name in MODELS
    for ep in (False, True)
]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return greedy_reference(checkpoint)


@pytest.mark.parametrize("checkpoint", MODELS, indirect=True)
def test_chunked_prefill_and_prefix_hits(checkpoint, reference):
    llm = float32_engine(checkpoint, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    generate_and_check(llm, random_prompts(5, 20, 50, seed=1), reference)
    check_prefix_hits(llm, reference)
    llm.shutdown()


@pytest.mark.parametrize(("checkpoint", "expert_parallel"), TWO_RANKS, indirect=["checkpoint"])
def test_two_ranks(checkpoint, reference, expert_parallel):
    llm = float32_engine(checkpoint, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    generate_and_check(llm, random_prompts(4, 3, 40, seed=2), reference)
    llm.shutdown()


def test_experts_that_do_not_divide_over_the_ranks_are_refused(fake_tp, monkeypatch):
    from models import parallel_state

    fake_tp(0, 3)
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", True)
    with pytest.raises(ValueError, match="8 experts do not divide over 3 ranks"):
        FusedMoE(8, 2, 64, 32, renormalize=True, prefix="layers.0.mlp.experts")
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", False)
    with pytest.raises(ValueError, match="intermediate size 32 does not divide over 3"):
        FusedMoE(8, 2, 64, 32, renormalize=True, prefix="layers.0.mlp.experts")
