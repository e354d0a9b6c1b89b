"""Async scheduling in-process (steps run pipelined on the executor's thread while the next
one is scheduled): greedy tokens equal transformers' under chunked prefill, preemption and
prefix hits; stop conditions cut exactly where the synchronous engine cuts; seeded sampling,
logprobs and every sampling feature give what the synchronous engine gives (fp32, tiny
random checkpoint, CPU)."""

import pytest

from splitserve import LLM, SamplingParams
from tests.integration.greedy import (
    generate_and_check,
    greedy_reference,
    random_prompts,
)
from worker.step_output import LaunchedStep


@pytest.fixture(autouse=True, params=["pipelined", "done-first"])
def launch_order(request, monkeypatch):
    """On CPU a launched step is always done, so it is answered before the next launch;
    "pipelined" makes steps look unfinished, so the next one is launched first and fed
    the samples on the device, as on a busy GPU."""
    if request.param == "pipelined":
        monkeypatch.setattr(LaunchedStep, "done", lambda self: False)
    return request.param


@pytest.fixture(scope="module")
def reference(checkpoint):
    return greedy_reference(checkpoint)


def _engine(checkpoint: str, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("max_model_len", 256)
    llm = LLM(checkpoint, dtype="float32", async_scheduling=async_scheduling, **kw)
    assert llm.engine.max_in_flight == int(async_scheduling)
    return llm


def test_greedy_matches_transformers_with_chunks_preemption_and_prefix_hits(checkpoint, reference):
    llm = _engine(
        checkpoint,
        True,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=17,  # one request of max_model_len: preemption
    )
    engine, submit = llm.engine, llm.engine.executor.submit
    ahead = []  # steps sent while another was in flight

    def recording_submit(scheduler_output):
        ahead.append(len(engine.in_flight))
        submit(scheduler_output)

    engine.executor.submit = recording_submit
    shared = random_prompts(1, 20, 20, seed=8)[0]
    prompts = random_prompts(6, 20, 40, seed=4) + [shared + [1], shared + [2, 3]]
    generate_and_check(llm, prompts, reference)
    assert sum(ahead) > len(ahead) // 2
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert llm.engine.kv_cache_manager.usage == 0.0 and not llm.engine.in_flight


def test_stop_conditions_cut_where_the_synchronous_engine_cuts(checkpoint, reference):
    prompts = random_prompts(4, 5, 30, seed=9)
    expected = [reference(prompt, 10) for prompt in prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[expected[1][4]]),
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[expected[2][0]], min_tokens=2),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    outputs = {}
    for mode in (False, True):
        llm = _engine(checkpoint, mode)
        outputs[mode] = [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        llm.shutdown()
    assert outputs[True] == outputs[False]
    tokens = [t for t, _ in outputs[True]]
    assert tokens[0] == expected[0][:3] and tokens[3] == expected[3][:1]
    cut = expected[1].index(expected[1][4]) + 1
    assert tokens[1] == expected[1][:cut]


def test_seeded_sampling_equals_the_synchronous_engine(checkpoint):
    prompts = random_prompts(5, 5, 30, seed=10)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results = []
    for mode in (False, True):
        llm = _engine(checkpoint, mode, max_num_batched_tokens=16)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert results[0] == results[1]


def test_pipelined_steps_equal_the_synchronous_engine_with_every_sampling_feature(checkpoint):
    """Rows fed from the last step's samples on the device, next to rows whose sampling
    reads their tokens so far (penalties, min_tokens, bad words: those steps are finished
    first), with logprobs, seeds, stops and requests ending at different steps."""
    prompts = random_prompts(8, 3, 30, seed=11)
    plain = dict(temperature=0.8, top_p=0.9, ignore_eos=True)
    params = [
        SamplingParams(seed=1, max_tokens=9, logprobs=2, **plain),
        SamplingParams(seed=2, max_tokens=12, repetition_penalty=1.3, **plain),
        SamplingParams(temperature=0, max_tokens=5, logprobs=0),
        SamplingParams(seed=4, max_tokens=14, **plain),
        SamplingParams(seed=5, max_tokens=8, frequency_penalty=0.5, presence_penalty=0.2, **plain),
        SamplingParams(seed=6, max_tokens=10, bad_words_token_ids=[[7], [3, 9]], **plain),
        SamplingParams(temperature=0, max_tokens=11, min_tokens=6, stop_token_ids=[5, 17]),
        SamplingParams(seed=8, max_tokens=3, n=2, **plain),
    ]

    def run(async_scheduling: bool):
        llm = _engine(checkpoint, async_scheduling, max_num_batched_tokens=24)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
        return [
            [(c.token_ids, c.finish_reason, c.logprobs, c.cumulative_logprob) for c in o.outputs]
            for o in outs
        ]

    assert run(True) == run(False)
