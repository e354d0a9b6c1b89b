"""The API tests again, through the real AsyncEngineClient, the ZMQ protocol and a real
tokenizer, against the scripted EngineCore of tests/ipc (it echoes the prompt). Left out:
the tests that need logprobs or engine token counters, which that engine does not make."""

from __future__ import annotations

import pytest

from ipc.client import AsyncEngineClient
from ipc.tokenizer import Tokenizer
from tests.ipc.client_fakes import FAIL_MESSAGE, FAIL_TOKEN, FakeEngine, tiny_tokenizer_path
from tests.server.conftest import EngineHarness
from tests.server.test_openai_api import (  # noqa: F401  (collected again with this engine)
    _metrics,
    test_chat_stream,
    test_chat_text_and_usage_match_the_engine,
    test_chat_without_max_tokens_may_fill_the_context,
    test_completion_of_token_ids_defaults_to_16_tokens,
    test_completion_stream_with_usage,
    test_completion_text_and_usage_match_the_engine,
    test_disconnect_mid_stream_aborts_the_request,
    test_health_is_200_while_the_engine_answers,
    test_invalid_parameters_are_400_in_openai_shape,
    test_malformed_bodies_are_400,
    test_models_lists_the_served_model,
    test_prompt_longer_than_the_context_is_400_naming_the_limit,
    test_sse_wire_format_ends_with_done,
    test_stop_strings_cut_the_text,
    test_unknown_model_is_404,
    test_wrong_api_key_is_401,
)


@pytest.fixture(scope="module")
def engine():
    with FakeEngine() as fake:
        tokenizer = Tokenizer.from_pretrained(tiny_tokenizer_path())
        client = AsyncEngineClient(fake.address, tokenizer=tokenizer)
        yield EngineHarness(client, tokenizer, "tiny", 256, fake.aborted.__contains__)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_is_400_with_its_message(http, engine, stream):
    body = {"model": engine.model_name, "prompt": [FAIL_TOKEN, 5], "stream": stream}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == FAIL_MESSAGE


def test_metrics_carry_the_engine_stats(http):
    assert _metrics(http)[("splitserve:num_requests_running", ())] == 0
