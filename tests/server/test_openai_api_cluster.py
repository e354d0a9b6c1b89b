"""The API tests once more, end to end: the official openai client → the HTTP server →
AsyncEngineClient → a real EngineCore process and worker (launch.py, tiny random Llama,
fp32). Text and usage must equal what the engine client itself returns."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ipc.client import AsyncEngineClient, EngineClient
from ipc.tokenizer import Tokenizer
from tests.cluster.helpers import launch_cluster
from tests.models.tiny import load_reference, make_tiny_checkpoint
from tests.server.conftest import EngineHarness
from tests.server.test_api_features import (  # noqa: F401  (collected again with this engine)
    test_a_request_id_already_running_is_400,
    test_a_stop_token_is_the_stop_reason_and_not_text,
    test_chat_choices_carry_stop_reason,
    test_continuous_usage_stats_put_the_usage_in_every_chunk,
    test_echo_puts_the_prompt_before_the_completion,
    test_length_has_no_stop_reason,
    test_metrics_have_vllm_names_with_the_model_name,
    test_priority_reaches_the_engine,
    test_stop_strings_give_stop_reason_and_may_stay_in_the_text,
    test_tokenize_and_detokenize_in_vllm_shapes,
    test_truncate_prompt_tokens_keeps_the_last_ones,
    test_version,
    test_x_request_id_is_echoed_and_names_the_response,
)
from tests.server.test_api_refusals import (  # noqa: F401  (collected again with this engine)
    test_no_op_values_are_accepted,
    test_the_openai_client_sees_refusals_as_bad_requests,
    test_unknown_fields_are_400_naming_them,
)
from tests.server.test_openai_api import (  # noqa: F401  (collected again with this engine)
    _metrics,
    test_chat_logprobs_in_openai_shape,
    test_chat_stream,
    test_chat_text_and_usage_match_the_engine,
    test_completion_logprobs_in_openai_shape,
    test_completion_of_token_ids_defaults_to_16_tokens,
    test_completion_stream_with_usage,
    test_completion_text_and_usage_match_the_engine,
    test_health_is_200_while_the_engine_answers,
    test_invalid_parameters_are_400_in_openai_shape,
    test_metrics_parse_and_move_after_a_request,
    test_prompt_longer_than_the_context_is_400_naming_the_limit,
    test_sse_wire_format_ends_with_done,
    test_stop_strings_cut_the_text,
    test_unknown_model_is_404,
    test_wrong_api_key_is_401,
)

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("api-cluster")
    path = make_tiny_checkpoint(folder, "llama", name="llama")
    with launch_cluster(folder, path, "--tp", "1", "--max-model-len", str(MAX_MODEL_LEN)) as c:
        yield c


@pytest.fixture(scope="module")
def text_prompt() -> str:
    return "abc"  # the tiny random model answers it in printable bytes


@pytest.fixture(scope="module")
def stats_client(cluster):
    with EngineClient(cluster.address) as client:
        yield client


@pytest.fixture(scope="module")
def engine(cluster, stats_client):
    tokenizer = Tokenizer.from_pretrained(cluster.model)
    client = AsyncEngineClient(cluster.address, tokenizer=tokenizer)

    def idle(_request_id: str) -> bool:
        stats = stats_client.stats()
        return stats.num_running == 0 and stats.num_waiting == 0

    return EngineHarness(client, tokenizer, "llama", MAX_MODEL_LEN, idle)


def test_disconnect_mid_stream_frees_the_engine(http, engine, stats_client):
    max_tokens = MAX_MODEL_LEN - 8
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


def test_echo_logprobs_and_prompt_logprobs_match_transformers(oai, cluster, engine):
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
        logits = load_reference(cluster.model)(torch.tensor([prompt])).logits[0, :-1]
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
