"""What the server does over the real AsyncEngineClient and the ZMQ protocol that only the
scripted EngineCore of tests/ipc shows: its refusals, and its stats in /metrics. The
tests every engine passes run against it from their own modules (the `engines` mark)."""

from __future__ import annotations

import time

import pytest

from tests.ipc.client_fakes import FAIL_MESSAGE, FAIL_TOKEN
from tests.server.api_helpers import read_metrics

pytestmark = pytest.mark.engines("zmq")


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
    labels = (("engine", "0"), ("model_name", engine.model_name))
    key = ("splitserve:num_requests_running", labels)
    assert read_metrics(http)[key] == 0
