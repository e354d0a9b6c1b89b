"""Speculative decoding end to end on a tiny random checkpoint in float32 on CPU, with
ngram drafts and with a draft model (the checkpoint cut to one layer): greedy tokens equal
transformers' under chunked prefill, preemption and prefix hits, in lockstep and with async
scheduling; every sampling feature gives the tokens plain decoding gives (seeded streams
included); workers in processes of their own (tensor parallel); the target as its own
draft accepts every draft; a draft of another vocabulary or tokenizer is refused."""

import json
import re
from pathlib import Path

import pytest

from splitserve import LLM, SamplingParams, StructuredOutputsParams
from tests.integration.greedy import greedy_reference, random_prompts
from tests.models.tiny import make_tiny_checkpoint, truncate_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# Always speculate: the tiny model's tokens repeat too little for the gate's default.
ALWAYS = {**SPEC, "adaptive": False}


@pytest.fixture(scope="module")
def reference(checkpoint):
    return greedy_reference(checkpoint)


@pytest.fixture(scope="module")
def draft_checkpoint(checkpoint, tmp_path_factory) -> str:
    return truncate_checkpoint(checkpoint, tmp_path_factory.mktemp("draft"), 1)


@pytest.fixture(params=["ngram", "draft_model"])
def always(request, draft_checkpoint) -> dict:
    """A config that speculates in every step, by each method."""
    if request.param == "ngram":
        return ALWAYS
    return {"method": "draft_model", "model": draft_checkpoint, "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip


def repetitive_prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so that prompt lookup has something to propose, and
    plain random ones."""
    phrases = random_prompts(3, 3, 6, seed=seed)
    return [p * 4 for p in phrases] + random_prompts(3, 5, 30, seed=seed + 1)


def _engine(checkpoint: str, spec: dict | None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("max_model_len", 256)
    return LLM(checkpoint, dtype="float32", speculative_config=spec, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_drafts_matches_transformers(checkpoint, reference, async_scheduling, always):
    llm = _engine(
        checkpoint,
        always,
        async_scheduling=async_scheduling,
        block_size=4,
        max_model_len=96,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=30,  # fewer than the prompts need together: preemption
    )
    prompts = repetitive_prompts(seed=20)
    prompts += [prompts[0] + [1], prompts[0] + [2, 3]]  # prefix hits
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference(prompt, 24)
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert llm.engine.kv_cache_manager.usage == 0.0
    llm.shutdown()


def test_every_sampling_feature_gives_the_tokens_of_plain_decoding(checkpoint, always):
    """Per-position settings: penalties, min_tokens and bad words see the drafts before
    each position; seeded streams draw once per produced token, so a seeded request's
    tokens are those it gets without drafts; logprobs are per position."""
    prompts = repetitive_prompts(seed=30) + random_prompts(2, 3, 20, seed=31)
    plain = dict(temperature=0.8, top_p=0.9, ignore_eos=True)
    params = [
        SamplingParams(seed=1, max_tokens=9, logprobs=2, **plain),
        SamplingParams(seed=2, max_tokens=12, repetition_penalty=1.3, **plain),
        SamplingParams(temperature=0, max_tokens=15, logprobs=0),
        SamplingParams(seed=4, max_tokens=14, top_k=5, **plain),
        SamplingParams(seed=5, max_tokens=8, frequency_penalty=0.5, presence_penalty=0.2, **plain),
        SamplingParams(seed=6, max_tokens=10, bad_words_token_ids=[[7], [3, 9]], **plain),
        SamplingParams(temperature=0, max_tokens=11, min_tokens=6, stop_token_ids=[5, 17]),
        SamplingParams(temperature=0, max_tokens=12, logit_bias={11: 3.0}),
    ]

    def run(spec):
        llm = _engine(checkpoint, spec, max_num_batched_tokens=24)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.get_stats()
        llm.shutdown()
        return [o.outputs[0] for o in outs], stats

    expected, _ = run(None)
    got, stats = run(always)
    assert stats.spec_decode_num_accepted_tokens > 0
    for want, have in zip(expected, got, strict=True):
        assert (have.token_ids, have.finish_reason) == (want.token_ids, want.finish_reason)
        assert (have.logprobs is None) == (want.logprobs is None)
        for a, b in zip(have.logprobs or [], want.logprobs or [], strict=True):
            assert a.keys() == b.keys()
            for token_id, entry in a.items():
                assert entry.logprob == pytest.approx(b[token_id].logprob, abs=1e-4)


# draft_model: 12 s, slow (test_the_target_as_its_own_draft_accepts_every_draft runs a draft
# model on two ranks)
@pytest.mark.parametrize(
    "always", ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)], indirect=True
)
def test_worker_processes_verify_drafts_in_lockstep(checkpoint, reference, always):
    llm = _engine(checkpoint, always, tensor_parallel_size=2)
    assert llm.engine.max_in_flight == 1  # async scheduling is on with worker processes
    prompts = repetitive_prompts(seed=40)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False), strict=True):
        assert out.outputs[0].token_ids == reference(prompt, 20)
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    llm.shutdown()


def test_structured_output_drafts_are_cut_by_the_grammar(checkpoint, always):
    """Drafts a grammar forbids are cut before they are verified, and each position is
    masked after the drafts before it: the outputs are those of plain decoding and match
    the grammar."""
    regex = r"(ab|cd|ef){3,8}-[0-9]{2}"
    prompts = ["abcdab" * 3, "cdcdcd" * 3, "efabef" * 2, "xyz"]
    params = [
        SamplingParams(temperature=t, seed=3, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(regex=regex))
        for t in (0.0, 1.0, 0.0, 1.0)
    ]  # fmt: skip

    def run(spec):
        llm = _engine(checkpoint, spec)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.get_stats()
        llm.shutdown()
        return [(o.text, o.finish_reason) for o in outs], stats

    expected, _ = run(None)
    got, stats = run(always)
    assert got == expected

    assert all(re.fullmatch(regex, text) for text, _ in got)
    # The tiny draft model drafts without the grammar: nearly all its drafts are cut.
    if always["method"] == "ngram":
        assert stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize(
    ("k", "temperature", "tp", "truncation"),
    [
        (1, 0.0, 1, {}),
        (4, 0.0, 1, {}),
        (3, 0.8, 1, {}),
        (3, 0.8, 1, {"top_k": 20, "top_p": 0.9, "min_p": 0.02}),
        (2, 0.8, 2, {}),
    ],
)
def test_the_target_as_its_own_draft_accepts_every_draft(
    checkpoint, reference, k, temperature, tp, truncation
):
    """Greedy: the drafts are the target's own greedy tokens. Random (unseeded): each draft
    is drawn from q = p (top-k, top-p and min-p applied to both), which min(1, p/q) always
    accepts (tp=2: rank 0 draws and keeps q, and its verdicts reach the other rank)."""
    spec = {"method": "draft_model", "model": checkpoint, "num_speculative_tokens": k,
            "adaptive": False}  # fmt: skip
    llm = _engine(
        checkpoint, spec, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=tp
    )
    prompts = random_prompts(5, 3, 30, seed=50)
    sp = SamplingParams(temperature=temperature, max_tokens=21, ignore_eos=True, **truncation)
    for prompt, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False), strict=True):
        assert len(out.outputs[0].token_ids) == 21
        if temperature == 0:
            assert out.outputs[0].token_ids == reference(prompt, 21)
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    # After the prefill's token, each verification gives k + 1 tokens (max_tokens permitting).
    assert stats.spec_decode_num_drafts <= len(prompts) * -(-20 // (k + 1))
    llm.shutdown()


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(checkpoint, tmp_path):
    other_vocab = make_tiny_checkpoint(tmp_path, "llama", name="v300", vocab_size=300)
    spec = {"method": "draft_model", "model": other_vocab}
    with pytest.raises(Exception, match="vocabulary of 300 tokens, the target 288"):
        _engine(checkpoint, spec)
    other_tokenizer = truncate_checkpoint(checkpoint, tmp_path, 1)
    tokenizer_json = Path(other_tokenizer) / "tokenizer.json"
    tokenizer = json.loads(tokenizer_json.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two byte tokens swap ids
    tokenizer_json.write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        _engine(checkpoint, {"method": "draft_model", "model": other_tokenizer})


@pytest.mark.parametrize("swap", [False, True])
def test_a_draft_of_another_shape_drafts_its_own_greedy_tokens(
    checkpoint, reference, tmp_path, swap
):
    """A draft with its own weights and KV shapes (one layer, one KV head of 16): every
    proposal is the draft's greedy continuation per transformers, so its KV cache holds its
    own keys and values of every token, and the target's tokens are transformers' own.
    With `swap`, preempted requests go to the host tier and back, the draft's pages too."""
    draft = make_tiny_checkpoint(
        tmp_path, "llama", name="small", seed=1, hidden_size=32, num_attention_heads=2,
        num_key_value_heads=1, num_hidden_layers=1, intermediate_size=48,
    )  # fmt: skip
    draft_reference = greedy_reference(draft)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    swapping = {}
    if swap:
        swapping = dict(num_gpu_blocks_override=24, kv_offload_memory=4 << 20,
                        preemption_mode="swap", max_model_len=64)  # fmt: skip
    llm = _engine(checkpoint, spec, block_size=4, max_num_batched_tokens=16, **swapping)
    proposals = []
    store = llm.engine.scheduler.spec.proposer.store
    llm.engine.scheduler.spec.proposer.store = lambda *a: (proposals.append(a), store(*a))
    prompts = random_prompts(4, 5, 30, seed=60)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sequences = {}
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference(prompt, 16)
        sequences[out.request_id] = prompt + reference(prompt, 16)
    assert len(proposals) > 4 * 3
    for request_id, num_tokens, drafts in proposals:
        prefix = sequences[request_id][:num_tokens]
        assert drafts == draft_reference(prefix, len(drafts))
    if swap:
        stats = llm.engine.get_stats()
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    llm.shutdown()
