"""The API tests again, through the real AsyncEngineClient, the ZMQ protocol and a real
tokenizer, against the scripted EngineCore of tests/ipc (it echoes the prompt). Left out:
the tests that need logprobs or engine token counters, which that engine does not make."""

from __future__ import annotations

import time

import pytest

from ipc.client import AsyncEngineClient
from ipc.tokenizer import Tokenizer
from tests.ipc.client_fakes import FAIL_MESSAGE, FAIL_TOKEN, FakeEngine, tiny_tokenizer_path
from tests.server.conftest import EngineHarness
from tests.server.test_api_features import (  # noqa: F401  (collected again with this engine)
    test_a_request_id_already_running_is_400,
    test_continuous_usage_stats_put_the_usage_in_every_chunk,
    test_echo_puts_the_prompt_before_the_completion,
    test_length_has_no_stop_reason,
    test_stop_strings_give_stop_reason_and_may_stay_in_the_text,
    test_tokenize_and_detokenize_in_vllm_shapes,
    test_truncate_prompt_tokens_keeps_the_last_ones,
    test_x_request_id_is_echoed_and_names_the_response,
)
from tests.server.test_api_refusals import (  # noqa: F401  (collected again with this engine)
    test_no_op_values_are_accepted,
    test_unknown_fields_are_400_naming_them,
)
from tests.server.test_api_vllm_extras import (  # noqa: F401  (collected again with this engine)
    test_a_batch_echoes_each_prompt_before_its_choices,
    test_a_batch_of_prompts_answers_each_in_turn,
    test_a_batch_with_one_bad_prompt_is_refused_whole,
    test_a_streamed_batch_ends_with_the_usage_of_all_its_prompts,
    test_chat_return_token_ids_puts_the_prompt_ids_at_the_top,
    test_continue_final_message_lets_the_model_go_on_with_it,
    test_disconnecting_from_a_streamed_batch_aborts_each_prompt,
    test_return_token_ids_gives_the_prompt_and_choice_token_ids,
    test_stream_options_without_stream_are_400,
)
from tests.server.test_input_validation import (  # noqa: F401  (collected again with this engine)
    COMPLETION_FIELDS,
    test_cache_salt_is_a_short_non_empty_string,
    test_chat_integers_beyond_int64_are_400_naming_the_field,
    test_integers_beyond_int64_are_400_naming_the_field,
    test_known_roles_are_served,
    test_lone_surrogates_are_400_naming_the_field,
    test_non_finite_floats_are_400_naming_the_field,
    test_token_ids_outside_the_vocabulary_are_400_naming_the_field,
    test_unknown_roles_are_400_naming_messages,
)
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
        # The model's vocabulary: FAIL_TOKEN must reach the engine.
        vocab_size = FAIL_TOKEN + 1
        yield EngineHarness(client, tokenizer, "tiny", 256, fake.aborted.__contains__, vocab_size)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_is_400_with_its_message(http, engine, stream):
    body = {"model": engine.model_name, "prompt": [FAIL_TOKEN, 5], "stream": stream}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == FAIL_MESSAGE


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_the_engine_refuses_in_part_is_400_and_leaves_nothing_running(http, engine, stream):
    body = {
        "model": engine.model_name,
        "prompt": [[5, 6], [FAIL_TOKEN, 5], [7]],
        "max_tokens": 50,
        "ignore_eos": True,
        "stream": stream,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == FAIL_MESSAGE
    deadline = time.monotonic() + 10
    while engine.client._core.output_processor.has_unfinished_requests():
        assert time.monotonic() < deadline, "the batch's other requests stayed registered"
        time.sleep(0.02)


def test_metrics_carry_the_engine_stats(http, engine):
    key = ("splitserve:num_requests_running", (("model_name", engine.model_name),))
    assert _metrics(http)[key] == 0


def test_refused_requests_leave_nothing_registered_in_the_engine_client(http, engine):
    """Every refusal happens before the engine client registers the request (a request
    that failed to encode used to stay registered, and answer a plain-text 500)."""
    for extra, _ in COMPLETION_FIELDS:
        body = {"model": engine.model_name, "prompt": "Hi", "max_tokens": 2, **extra}
        assert http.post("/v1/completions", json=body).status_code == 400
    body = {"model": engine.model_name, "prompt": [5, engine.vocab_size], "max_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 400
    assert not engine.client._core.output_processor.has_unfinished_requests()
