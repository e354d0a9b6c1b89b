"""What the parity tests share: transformers' greedy tokens as the reference, random
prompts, and the engine's greedy generation."""

import random
from collections.abc import Callable

import torch

from splitserve import LLM, SamplingParams
from tests.models.tiny import load_reference

MAX_TOKENS = 12


def greedy_reference(path: str, ignore_eos: bool = True) -> Callable[..., list[int]]:
    """`greedy(prompt, max_tokens=MAX_TOKENS)`: transformers' greedy continuation, past EOS
    when ignore_eos, else ending with it, as the engine's SamplingParams(ignore_eos=...)."""
    model = load_reference(path)
    eos = {"eos_token_id": None} if ignore_eos else {}

    @torch.no_grad()
    def greedy(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            **eos,
        )
        return out[0, len(prompt) :].tolist()

    return greedy


def random_prompts(n: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(n)]


def generate_greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    params.setdefault("max_tokens", MAX_TOKENS)
    sp = SamplingParams(temperature=0, ignore_eos=True, **params)
    return llm.generate(prompts, sp, use_tqdm=False)
