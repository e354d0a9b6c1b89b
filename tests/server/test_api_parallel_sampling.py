"""`n` and `best_of` over HTTP: the official openai client → the server → a real cluster
(launch.py, tiny random Llama, fp32). Choice i of a seeded request is what a single
request with seed + i answers; streams carry every choice's index and finish."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest

from tests.cluster.helpers import wait_idle
from tests.server.api_helpers import assert_400_naming, read_metrics
from tests.server.harness import smollm2_server

pytestmark = pytest.mark.engines("cluster")

SAMPLED = {"temperature": 1.0, "max_tokens": 12, "seed": 3, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "abc"}]


def completion(oai, **kwargs):
    return oai.completions.create(model="llama", **{"prompt": "abc", **SAMPLED, **kwargs})


def test_completion_choices_are_the_seeded_single_requests(oai, stats_client):
    out = completion(oai, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    singles = [completion(oai, seed=3 + i).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == singles
    assert len(set(singles)) > 1
    assert out.usage.completion_tokens == 3 * 12
    assert all(c.finish_reason == "length" for c in out.choices)
    assert wait_idle(stats_client).kv_cache_usage == 0.0


def test_a_batch_numbers_each_prompts_choices_after_the_last_prompts(oai):
    prompts = ["abc", "xyz"]
    out = completion(oai, prompt=prompts, n=2)
    singles = [c.text for p in prompts for c in completion(oai, prompt=p, n=2).choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == singles
    streamed = defaultdict(str)
    for chunk in completion(oai, prompt=prompts, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(4)] == singles


def test_chat_stream_carries_every_choice_and_finishes_each_once(oai):
    whole = oai.chat.completions.create(model="llama", messages=MESSAGES, n=3, **SAMPLED)
    stream = oai.chat.completions.create(
        model="llama",
        messages=MESSAGES,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLED,
    )
    texts, roles, finishes = defaultdict(str), defaultdict(int), defaultdict(list)
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles[choice.index] += choice.delta.role == "assistant"
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert dict(roles) == {0: 1, 1: 1, 2: 1}
    assert dict(finishes) == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens == 3 * 12


def test_streamed_completion_logprobs_are_per_choice(oai):
    stream = completion(oai, n=2, logprobs=0, stream=True)
    tokens = defaultdict(list)
    for chunk in stream:
        for choice in chunk.choices:
            tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
    whole = completion(oai, n=2, logprobs=0)
    assert [tokens[i] for i in range(2)] == [c.logprobs.tokens for c in whole.choices]
    assert all(len(c.logprobs.tokens) == 12 for c in whole.choices)
    assert [c.logprobs.text_offset[0] for c in whole.choices] == [0, 0]


def test_best_of_answers_the_candidates_with_the_highest_cumulative_logprob(oai):
    out = completion(oai, n=2, best_of=4, logprobs=0)
    candidates = [completion(oai, seed=3 + i, logprobs=0).choices[0] for i in range(4)]
    ranked = sorted(candidates, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in out.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 2 * 12
    plain = completion(oai, n=2, best_of=4)
    assert [c.text for c in plain.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in plain.choices)


def test_echo_puts_the_prompt_before_every_choice(oai):
    out = completion(oai, n=2, echo=True, max_tokens=3)
    assert all(c.text.startswith("abc") and len(c.text) > 3 for c in out.choices)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 129}, "n"),
        ({"n": 0}, "n"),
        ({"n": -1}, "n"),
        ({"best_of": 129}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
        ({"n": "2"}, "n"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_n_and_best_of_are_400_naming_the_field(http, path, extra, param):
    body = {"prompt": "abc"} if path == "/v1/completions" else {"messages": MESSAGES}
    assert_400_naming(http.post(path, json={**body, **extra}), param)


def test_the_openai_client_sees_n_above_the_limit_as_a_bad_request(oai):
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        oai.chat.completions.create(model="llama", messages=MESSAGES, n=1000)


@pytest.mark.slow
def test_smollm2_chat_with_n_3(tmp_path):
    question = [{"role": "user", "content": "Name a colour."}]
    with smollm2_server(tmp_path) as oai:
        sampled = oai.chat.completions.create(
            model="smollm2", messages=question, n=3, temperature=1.0, max_tokens=16, seed=0
        )
        greedy = oai.chat.completions.create(
            model="smollm2", messages=question, n=3, temperature=0, max_tokens=16
        )
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert all(c.message.content for c in sampled.choices)
    assert len({c.message.content for c in sampled.choices}) > 1
    assert len({c.message.content for c in greedy.choices}) == 1
    assert 3 <= sampled.usage.completion_tokens <= 3 * 16


def test_request_metrics_count_each_request_once_with_its_choices(oai, http):
    def sums() -> dict[str, float]:
        found = read_metrics(http)
        return {
            name: value for (name, _), value in found.items() if name.endswith(("_sum", "_count"))
        }

    before = sums()
    out = completion(oai, n=2, max_tokens=12)
    after = sums()

    def grew(name: str, part: str = "sum") -> float:
        key = f"splitserve:{name}_{part}"
        return after[key] - before.get(key, 0.0)

    assert grew("request_params_n") == 2 and grew("request_params_max_tokens") == 12
    assert grew("request_generation_tokens") == 24 == out.usage.completion_tokens
    assert grew("request_max_num_generation_tokens") == 12
    computed = grew("request_prefill_kv_computed_tokens")
    assert 1 <= computed <= out.usage.prompt_tokens
    # The EngineCore's phase times: one per engine request, each choice's, as in vLLM.
    phases = ("queue", "prefill", "decode", "inference")
    assert [grew(f"request_{phase}_time_seconds", "count") for phase in phases] == [2] * 4
    assert grew("request_decode_time_seconds") > 0
    assert grew("request_inference_time_seconds") >= grew("request_decode_time_seconds")
    assert grew("request_time_per_output_token_seconds", "count") == 2
    assert grew("request_num_preemptions", "count") == 2
    assert grew("iteration_tokens_total", "count") >= 12  # one step per token, at least
