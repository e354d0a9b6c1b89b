"""The default model (SmolLM2-135M, 9 heads) split over 3 ranks answers as 1 rank does."""

from __future__ import annotations

import pytest

from ipc.client import EngineClient
from ipc.sampling_params import SamplingParams
from tests.cluster.helpers import launch_cluster

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.mark.slow
def test_tp3_equals_tp1_greedy(tmp_path):
    from models.default import default_model_path

    model = default_model_path()
    params = SamplingParams(temperature=0.0, max_tokens=16)
    answers = {}
    for tp in ("1", "3"):
        folder = tmp_path / f"tp{tp}"
        folder.mkdir()
        with (
            launch_cluster(folder, model, "--tp", tp, "--max-model-len", "256") as cluster,
            EngineClient(cluster.address, tokenizer=model) as client,
        ):
            answers[tp] = [client.generate(p, params).outputs[0].token_ids for p in PROMPTS]
    assert answers["3"] == answers["1"]
    assert all(answers["1"])
