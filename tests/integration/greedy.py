"""What the parity tests share: transformers' greedy tokens as the reference, random
prompts, the engine's greedy generation checked against the reference, and the prefix-hit
scenario."""

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


def float32_engine(checkpoint: str, **kw) -> LLM:
    """The engine on a tiny checkpoint in float32, with a small KV cache and context."""
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("max_model_len", 256)
    return LLM(checkpoint, dtype="float32", **kw)


def random_prompts(n: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(n)]


def generate_greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    params.setdefault("max_tokens", MAX_TOKENS)
    sp = SamplingParams(temperature=0, ignore_eos=True, **params)
    return llm.generate(prompts, sp, use_tqdm=False)


def generate_and_check(llm: LLM, prompts: list[list[int]], reference: Callable) -> list:
    """The engine's greedy outputs of `prompts`, each checked against `reference` (a
    greedy_reference)."""
    outs = generate_greedy(llm, prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference(prompt)
    return outs


def check_prefix_hits(llm: LLM, reference: Callable) -> None:
    """Four prompts sharing a 40-token prefix, the first generated alone: the other three
    find all 40 tokens cached, and every continuation is the reference's."""
    shared = random_prompts(1, 40, 40, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 12, seed=3)]
    first = generate_and_check(llm, prompts[:1], reference)
    rest = generate_and_check(llm, prompts[1:], reference)
    assert first[0].num_cached_tokens == 0
    assert all(out.num_cached_tokens == 40 for out in rest)
