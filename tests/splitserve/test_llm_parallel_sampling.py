"""n and best_of through LLM on a tiny random Llama (fp32, in-process): the choices of one
request are the single requests their seeds make, the prompt is computed once, and
best_of keeps the candidates with the highest cumulative logprob."""

import pytest

from splitserve import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 250 for i in range(40)]
SAMPLED = dict(temperature=1.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)


def generate(llm: LLM, prompt=PROMPT, **params):
    (out,) = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    return out


def test_greedy_choices_equal_each_other_and_one_request_and_share_the_prompt(llm):
    prompt = [p ^ 1 for p in PROMPT]  # blocks no earlier test cached
    out = generate(llm, prompt, n=3, temperature=0, max_tokens=12, ignore_eos=True)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    single = generate(llm, prompt, temperature=0, max_tokens=12, ignore_eos=True)
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    block_size = llm.config.block_size
    assert out.num_cached_tokens == (len(prompt) - 1) // block_size * block_size
    assert llm.engine.get_stats().num_prompt_tokens >= len(prompt)


def test_seeded_choices_are_reproducible_differ_and_equal_seed_plus_index(llm):
    out = generate(llm, n=3, seed=11, **SAMPLED)
    again = generate(llm, n=3, seed=11, **SAMPLED)
    tokens = [c.token_ids for c in out.outputs]
    assert tokens == [c.token_ids for c in again.outputs]
    assert len(set(map(tuple, tokens))) > 1
    for index, choice_tokens in enumerate(tokens):
        assert generate(llm, seed=11 + index, **SAMPLED).outputs[0].token_ids == choice_tokens


def test_unseeded_choices_differ(llm):
    out = generate(llm, n=3, **SAMPLED)
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_best_of_returns_the_highest_cumulative_logprobs(llm):
    out = generate(llm, n=2, best_of=4, seed=5, **SAMPLED)
    candidates = [generate(llm, seed=5 + i, logprobs=0, **SAMPLED) for i in range(4)]
    scored = sorted(
        (
            (sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)), c.token_ids)
            for c in (candidate.outputs[0] for candidate in candidates)
        ),
        reverse=True,
    )
    assert [c.token_ids for c in out.outputs] == [tokens for _, tokens in scored[:2]]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([s for s, _ in scored[:2]])
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None for c in out.outputs)


def test_per_prompt_parameters_mix_single_and_parallel_requests(llm):
    params = [SamplingParams(n=2, seed=1, **SAMPLED), SamplingParams(seed=1, **SAMPLED)]
    both = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert [len(o.outputs) for o in both] == [2, 1]
    assert both[0].outputs[0].token_ids == both[1].outputs[0].token_ids


def test_prompt_logprobs_come_once_for_all_choices(llm):
    prompt = [p ^ 2 for p in PROMPT]  # blocks no earlier test cached
    out = generate(llm, prompt, n=3, prompt_logprobs=2, temperature=0, max_tokens=4)
    single = generate(llm, prompt, prompt_logprobs=2, temperature=0, max_tokens=4)
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for got, want in zip(out.prompt_logprobs[1:], single.prompt_logprobs[1:], strict=True):
        assert list(got) == list(want)
        assert [lp.logprob for lp in got.values()] == pytest.approx(
            [lp.logprob for lp in want.values()], abs=1e-5
        )
