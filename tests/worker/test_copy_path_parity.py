"""The engine through the copy path of the staging arena (a separate device arena forced on
CPU, as on CUDA) against transformers: greedy tokens match exactly with chunked prefill
mixing prefills and decodes, on one and on two KV cache groups; seeded sampling draws the
same tokens as the shared arena."""

import functools

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.integration.greedy import (
    generate_and_check,
    greedy_reference,
    random_prompts,
)
from worker.model_runner import ModelRunner

# tiny checkpoint -> attention backend. The hybrid's block tables are row-strided views of
# the arena, which the CPU kernel does not take: torch backend.
BACKENDS = {"llama": "auto", "qwen2-hybrid": "torch"}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def model(request, tiny_checkpoint):
    return tiny_checkpoint(request.param), BACKENDS[request.param]


def _engine(model, monkeypatch, separate: bool) -> LLM:
    if separate:
        runner = functools.partial(ModelRunner, separate_device_arena=True)
        monkeypatch.setattr("worker.inproc_executor.ModelRunner", runner)
    llm = LLM(
        model[0],
        dtype="float32",
        kv_cache_memory=4 << 20,
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        attention_backend=model[1],
    )
    monkeypatch.undo()
    runner = llm.engine.executor.runner
    assert runner.inputs.arena.separate == (separate or runner.device.type == "cuda")
    return llm


def test_greedy_tokens_match_transformers(model, monkeypatch):
    reference = greedy_reference(model[0])
    prompts = random_prompts(6, 1, 40, seed=4)
    generate_and_check(_engine(model, monkeypatch, separate=True), prompts, reference)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the device arena is always separate")
def test_seeded_sampling_matches_the_shared_arena(model, monkeypatch):
    prompts = random_prompts(5, 2, 30, seed=5)
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, top_k=20, min_p=0.02, seed=i, max_tokens=10)
        for i in range(len(prompts))
    ]

    def tokens(separate: bool) -> list[list[int]]:
        llm = _engine(model, monkeypatch, separate)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [out.outputs[0].token_ids for out in outputs]

    assert tokens(separate=True) == tokens(separate=False)
