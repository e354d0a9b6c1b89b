"""What the HTTP API tests share: the engine's own answers to compare with, request
bodies, and checks of the answers."""

from __future__ import annotations

import json
import time

from prometheus_client.parser import text_string_to_metric_families

from ipc.sampling_params import SamplingParams

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def engine_answer(live_server, engine, prompt_token_ids: list[int], **params):
    """What the engine itself generates for these token ids (greedy)."""
    params = SamplingParams(temperature=0.0, **params)
    return live_server.call(engine.client.generate(prompt_token_ids, params)).outputs[0]


def chat_ids(engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def assert_400_naming(response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def read_metrics(http) -> dict[tuple, float]:
    """/metrics parsed: (sample name, sorted labels) -> value."""
    text = http.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def long_completion(engine, prompt: str | list[str], stream: bool) -> dict:
    """A body that runs long enough to leave in the middle of."""
    max_tokens = engine.max_model_len // 2
    return {"model": engine.model_name, "prompt": prompt, "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}  # fmt: skip


def first_chunk_id(http, body: dict) -> str:
    """The id of a stream's first chunk; the connection is closed after it."""
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        return json.loads(next(line for line in lines if line)[6:])["id"]


def wait_for_aborts(engine, *request_ids: str) -> None:
    deadline = time.monotonic() + 10
    while not all(map(engine.aborted, request_ids)):
        assert time.monotonic() < deadline, f"the engine never saw {request_ids} aborted"
        time.sleep(0.02)
