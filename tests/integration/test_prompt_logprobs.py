"""Prompt logprobs through LLM against transformers' own forward (fp32 tiny Llama): each
prompt token's logprob given the tokens before it, its rank and the top-k, with chunked
prefill, a prefix that would be cached, and preemption in play. Also bad words end to
end, through the tokenizer."""

import random

import numpy as np
import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.models.tiny import load_reference

ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_reference(checkpoint)

    @torch.no_grad()
    def prompt_logprobs(prompt: list[int]) -> np.ndarray:
        """[len(prompt) - 1, vocab]: row p - 1 is the distribution of prompt token p."""
        logits = model(torch.tensor([prompt])).logits[0, :-1]
        return logits.float().log_softmax(dim=-1).numpy()

    return prompt_logprobs


@pytest.fixture(scope="module")
def llm(checkpoint):
    """Chunked prefill (16 tokens a step), prefix caching in blocks of 8."""
    return LLM(
        checkpoint,
        dtype="float32",
        max_model_len=128,
        block_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        kv_cache_memory=8 << 20,
    )


def _prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _params(k: int | None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 4)
    return SamplingParams(temperature=0, ignore_eos=True, prompt_logprobs=k, **kw)


def check_prompt_logprobs(out, k: int, expected: np.ndarray) -> None:
    prompt = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry, ref = entries[p], expected[p - 1]
        assert next(iter(entry)) == prompt[p]  # the prompt's token first
        got, target = entry[prompt[p]], ref[prompt[p]]
        assert got.logprob == pytest.approx(target, abs=ATOL)
        # The rank, where ties within the tolerance could order either way.
        assert (ref > target + ATOL).sum() + 1 <= got.rank <= (ref > target - ATOL).sum() + 1
        top = sorted(entry.items(), key=lambda item: item[1].rank)[:k]
        top_ids, top_logprobs = [t for t, _ in top], [lp.logprob for _, lp in top]
        assert len(top) == k and set(entry) - set(top_ids) <= {prompt[p]}
        np.testing.assert_allclose(top_logprobs, np.sort(ref)[::-1][:k], atol=ATOL)
        np.testing.assert_allclose(ref[top_ids], top_logprobs, atol=ATOL)


def test_prompt_logprobs_match_transformers_with_chunked_prefill(llm, reference):
    prompts = _prompts(5, 1, 50, seed=0) + [[7]]
    ks = [0, 1, 5, 20, 3, 2]
    outs = llm.generate(prompts, [_params(k) for k in ks], use_tqdm=False)
    for out, k in zip(outs, ks, strict=True):
        check_prompt_logprobs(out, k, reference(out.prompt_token_ids))
    assert outs[-1].prompt_logprobs == [None]


def test_a_request_without_prompt_logprobs_samples_as_alone(llm):
    prompts = _prompts(3, 20, 40, seed=1)
    alone = llm.generate(prompts[:1], _params(None, max_tokens=8), use_tqdm=False)[0]
    mixed = llm.generate(
        prompts, [_params(None, max_tokens=8), _params(4), _params(0)], use_tqdm=False
    )
    assert alone.prompt_logprobs is None and mixed[0].prompt_logprobs is None
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_cached_prefix_still_gives_every_prompt_logprob(llm, reference):
    prompt = _prompts(1, 41, 41, seed=2)[0]
    first = llm.generate([prompt], _params(2), use_tqdm=False)[0]
    again = llm.generate([prompt], _params(2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_prompt_logprobs(again, 2, reference(prompt))
    assert again.prompt_logprobs == first.prompt_logprobs
    # The request computed its blocks anyway, and cached them for the others.
    assert llm.generate([prompt], _params(None), use_tqdm=False)[0].num_cached_tokens == 40


def test_preempted_requests_send_each_prompt_logprob_once(checkpoint, reference):
    llm = LLM(
        checkpoint,
        dtype="float32",
        block_size=8,
        max_model_len=64,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=24,
    )
    prompts = _prompts(6, 20, 40, seed=4)
    outs = llm.generate(prompts, _params(3, max_tokens=12), use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    for out in outs:
        check_prompt_logprobs(out, 3, reference(out.prompt_token_ids))


def test_a_bad_word_is_never_generated(llm):
    tokenizer = llm.tokenizer
    prompt = tokenizer.encode("abc", add_special_tokens=False)
    plain = llm.generate([prompt], _params(None, max_tokens=8), use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    word = tokenizer.decode([first])
    assert tokenizer.encode(word, add_special_tokens=False) == [first]
    banned = llm.generate([prompt], _params(None, max_tokens=8, bad_words=[word]), use_tqdm=False)
    assert first not in banned[0].outputs[0].token_ids


def test_logits_are_made_a_few_positions_at_a_time(llm, reference, monkeypatch):
    import worker.prompt_logprobs

    monkeypatch.setattr(worker.prompt_logprobs, "LOGITS_BYTES", 3 * 4 * llm.config.vocab_size)
    prompts, ks = _prompts(2, 10, 30, seed=5), [4, 1]
    outs = llm.generate(prompts, [_params(k) for k in ks], use_tqdm=False)
    for out, k in zip(outs, ks, strict=True):
        check_prompt_logprobs(out, k, reference(out.prompt_token_ids))
