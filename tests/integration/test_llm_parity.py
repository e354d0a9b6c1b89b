"""The in-process engine against transformers: greedy tokens must match exactly, with
chunked prefill, prefix hits and preemption in play (fp32, tiny random checkpoints)."""

import pytest

from splitserve import SamplingParams
from tests.integration.greedy import (
    MAX_TOKENS,
    check_prefix_hits,
    float32_engine,
    generate_and_check,
    generate_greedy,
    greedy_reference,
    random_prompts,
)

pytestmark = pytest.mark.parametrize("checkpoint", ["llama", "qwen3"], indirect=True)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return greedy_reference(checkpoint)


def test_many_prompts_of_different_lengths(checkpoint, reference):
    prompts = random_prompts(8, 1, 60)
    outs = generate_and_check(float32_engine(checkpoint), prompts, reference)
    assert all(out.outputs[0].finish_reason == "length" for out in outs)


def test_chunked_prefill(checkpoint, reference):
    llm = float32_engine(checkpoint, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = random_prompts(5, 20, 70, seed=1)
    generate_and_check(llm, prompts, reference)


def test_prefix_hits(checkpoint, reference):
    llm = float32_engine(checkpoint, block_size=8)
    check_prefix_hits(llm, reference)


def test_preemption(checkpoint, reference):
    llm = float32_engine(
        checkpoint,
        block_size=8,
        max_model_len=64,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=64,
    )
    prompts = random_prompts(6, 20, 40, seed=4)
    generate_and_check(llm, prompts, reference)
    assert llm.engine.get_stats().num_preemptions > 0


def test_min_tokens_blocks_stop_tokens(checkpoint, reference):
    prompt = random_prompts(1, 10, 10, seed=5)[0]
    first = reference(prompt)[0]
    llm = float32_engine(checkpoint)
    stop_early = generate_greedy(llm, [prompt], stop_token_ids=[first])[0]
    assert stop_early.outputs[0].token_ids == [first]
    assert stop_early.outputs[0].finish_reason == "stop"
    held = generate_greedy(llm, [prompt], stop_token_ids=[first], min_tokens=3)[0]
    assert held.outputs[0].token_ids[0] != first
    assert first not in held.outputs[0].token_ids[:3]


def test_seeded_sampling_is_independent_of_the_batch(checkpoint):
    llm = float32_engine(checkpoint)
    prompt = random_prompts(1, 10, 10, seed=6)[0]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    mixed = (
        llm.generate(
            random_prompts(3, 5, 30, seed=7) + [prompt], [others] * 3 + [sp], use_tqdm=False
        )[3]
        .outputs[0]
        .token_ids
    )
    assert alone == mixed
