"""The child requests of one n > 1 request compute their shared prompt once: a child is
admitted only once its sibling's whole prompt is scheduled (a partial chunk takes the rest
of the step's budget), and then finds the prompt's full blocks in the prefix cache, even
in the step that computes them. The stand-in executor checks every KV read."""

import pytest
from stand_in_executor import make_engine, run_to_completion

from ipc.client.parallel_sampling import child_requests
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams

BLOCK_SIZE = 4  # make_config's


def children(prompt_len: int, n: int = 3, **sampling) -> list[EngineCoreRequest]:
    prompt = list(range(500, 500 + prompt_len))
    params = SamplingParams(n=n, temperature=0, max_tokens=sampling.pop("max_tokens", 4))
    return child_requests(EngineCoreRequest("p", prompt, params, 0.0, **sampling))


def prompt_tokens_computed(executor, prompt_len: int) -> int:
    """Prompt positions the workers computed, over every step and request."""
    computed: dict[str, int] = {}
    total = 0
    for so in executor.outputs:
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        for req_id, num in zip(
            so.scheduled_cached_reqs.req_ids,
            so.scheduled_cached_reqs.num_computed_tokens,
            strict=True,
        ):
            computed[req_id] = num
        for req_id, num in so.num_scheduled_tokens.items():
            start = computed[req_id]
            total += max(0, min(start + num, prompt_len) - start)
            computed[req_id] = start + num
    return total


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_siblings_wait_for_the_chunked_prompt_then_hit_its_full_blocks(policy):
    engine, executor = make_engine(max_num_batched_tokens=32, scheduling_policy=policy)
    for request in children(50):
        engine.add_request(request)
    results = run_to_completion(engine)
    steps = [so.num_scheduled_tokens for so in executor.outputs]
    # 50 tokens: 12 full blocks (48) and 2. The siblings come in with the prompt's last
    # chunk, hit the 12 blocks and compute the 2 tokens of the partial block.
    assert steps[:3] == [
        {"0_p": 32},
        {"0_p": 18, "1_p": 2, "2_p": 2},
        {"0_p": 1, "1_p": 1, "2_p": 1},
    ]
    new = executor.outputs[1].scheduled_new_reqs
    assert [(r.req_id, r.num_computed_tokens) for r in new] == [("1_p", 48), ("2_p", 48)]
    assert prompt_tokens_computed(executor, 50) == 50 + 2 * 2
    assert results["0_p"] == results["1_p"] == results["2_p"]


def test_siblings_arriving_mid_prefill_are_admitted_with_the_last_chunk():
    engine, executor = make_engine(max_num_batched_tokens=32)
    first, *rest = children(50)
    engine.add_request(first)
    engine.step()
    for request in rest:
        engine.add_request(request)
    engine.step()
    assert [so.num_scheduled_tokens for so in executor.outputs] == [
        {"0_p": 32},
        {"0_p": 18, "1_p": 2, "2_p": 2},
    ]


def test_a_prompt_that_fits_is_computed_once_in_one_step():
    engine, executor = make_engine(max_num_batched_tokens=64)
    for request in children(48):  # 12 full blocks: the last token is always recomputed
        engine.add_request(request)
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            cached.setdefault(out.request_id, out.num_cached_tokens)
    assert executor.outputs[0].num_scheduled_tokens == {"0_p": 48, "1_p": 4, "2_p": 4}
    assert cached == {"0_p": 0, "1_p": 44, "2_p": 44}
    assert prompt_tokens_computed(executor, 48) <= 48 + 2 * BLOCK_SIZE


def test_siblings_under_kv_pressure_all_finish_and_free_every_block():
    engine, executor = make_engine(num_blocks=17, max_num_batched_tokens=32)
    for request in children(20, n=4, max_tokens=24):
        engine.add_request(request)
    results = run_to_completion(engine)
    assert engine.get_stats().num_preemptions > 0
    assert len({tuple(tokens) for tokens, _ in results.values()}) == 1
    assert all(reason == "length" for _, reason in results.values())
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 16
