"""Mistral and Gemma 3 through the engine (paged KV cache, chunked prefill, blocks
smaller than the window) against transformers' generate(): greedy tokens must match
exactly, for prompts shorter and longer than the window (8 tokens in the tiny models)."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.models.tiny import load_reference, make_tiny_checkpoint

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _reference_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    model = load_reference(path)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_tokens_match_transformers(checkpoint, backend):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    llm = LLM(
        checkpoint,
        dtype="float32",
        kv_cache_memory=8 << 20,
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=16,
        attention_backend=backend,
    )
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == _reference_greedy(checkpoint, prompts)
