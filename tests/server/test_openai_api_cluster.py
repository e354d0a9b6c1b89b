"""End to end, what only a real engine shows: the official openai client → the HTTP server
→ AsyncEngineClient → a real EngineCore process and worker (launch.py, tiny random Llama,
fp32): a disconnect frees the engine, logprobs equal transformers'. The tests every engine
passes run against this one from their own modules (the `engines` mark)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.models.tiny import load_reference

pytestmark = pytest.mark.engines("cluster")


def test_disconnect_mid_stream_frees_the_engine(http, engine, stats_client):
    max_tokens = engine.max_model_len - 8
    before = stats_client.stats().num_generation_tokens
    body = {
        "model": engine.model_name,
        "prompt": [1, 2, 3],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        json.loads(next(line for line in lines if line)[6:])
    deadline = time.monotonic() + 10
    while not engine.aborted(""):
        assert time.monotonic() < deadline, "the request still runs after the disconnect"
        time.sleep(0.02)
    assert stats_client.stats().num_generation_tokens - before < max_tokens
    assert stats_client.stats().kv_cache_usage == 0.0


def test_echo_logprobs_and_prompt_logprobs_match_transformers(oai, api_cluster, engine):
    prompt = [40, 7, 99, 200, 13, 65, 66, 67, 120]
    out = oai.completions.create(
        model=engine.model_name,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": 3, "bad_words": ["x"]},
    )
    with torch.no_grad():
        logits = load_reference(api_cluster.model)(torch.tensor([prompt])).logits[0, :-1]
    reference = logits.log_softmax(dim=-1)
    n = len(prompt)
    expected = reference[torch.arange(n - 1), prompt[1:]].tolist()
    choice = out.choices[0]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:n] == pytest.approx(expected, abs=1e-4)
    assert choice.logprobs.top_logprobs[0] is None
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:n])
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == n and prompt_logprobs[0] is None
    for p in range(1, n):
        entry = prompt_logprobs[p]
        assert entry[str(prompt[p])]["logprob"] == pytest.approx(expected[p - 1], abs=1e-4)
        top = reference[p - 1].topk(3)
        for rank, (token_id, logprob) in enumerate(zip(top.indices, top.values, strict=True), 1):
            assert entry[str(int(token_id))]["rank"] == rank
            assert entry[str(int(token_id))]["logprob"] == pytest.approx(float(logprob), abs=1e-4)


def test_every_choice_of_n_answers_the_prompt_logprobs(oai, engine):
    prompt = [41, 8, 98, 201, 14, 64, 67, 68, 121]
    kwargs = dict(model=engine.model_name, prompt=prompt, max_tokens=3, echo=True, logprobs=1)
    single = oai.completions.create(**kwargs, temperature=0).choices[0]
    out = oai.completions.create(**kwargs, n=2, seed=1, extra_body={"prompt_logprobs": 1})
    n = len(prompt)
    for choice in out.choices:
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:n] == pytest.approx(
            single.logprobs.token_logprobs[1:n], abs=1e-4
        )
        assert len(choice.model_extra["prompt_logprobs"]) == n
    assert sorted(c.index for c in out.choices) == [0, 1]
