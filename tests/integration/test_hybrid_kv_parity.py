"""Models with sliding-window layers against transformers, on KV cache groups: greedy tokens
match exactly with chunked prefill, prefix hits and preemption, while the window groups
hold only the blocks their window still sees (fp32, tiny random checkpoints)."""

import pytest

from ipc.messages import EngineCoreRequest
from ipc.utils import cdiv
from splitserve import LLM, SamplingParams
from tests.integration.greedy import (
    check_prefix_hits,
    generate_and_check,
    random_prompts,
)

WINDOW = 8

# tiny checkpoint (window 8 in each) -> each KV cache group's window as the workers report it
GROUP_WINDOWS = {
    "qwen2-hybrid": [None, WINDOW],
    "mistral": [WINDOW],
    # Five local layers to one global: six groups of one layer.
    "gemma3": [WINDOW] * 5 + [None],
}


pytestmark = pytest.mark.parametrize("model", sorted(GROUP_WINDOWS), indirect=True)


def _engine(model, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 << 20)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("block_size", 4)
    llm = LLM(model[0], dtype="float32", **kw)
    assert llm.engine.kv_cache_manager.group_windows == tuple(model[1])
    return llm


def test_prompts_longer_than_the_window(model, reference):
    llm = _engine(model)
    prompts = random_prompts(8, 1, 60)
    generate_and_check(llm, prompts, reference)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_chunked_prefill(model, reference, backend):
    llm = _engine(model, max_num_batched_tokens=6, max_num_seqs=4, attention_backend=backend)
    prompts = random_prompts(5, 20, 50, seed=1)
    generate_and_check(llm, prompts, reference)


def test_prefix_hits(model, reference):
    llm = _engine(model)
    check_prefix_hits(llm, reference)


def test_preemption(model, reference):
    # The fewest blocks the scheduler accepts: one request of max_model_len in every group
    # (a window group: the blocks a 16-token chunk and the window before it span).
    full = cdiv(64, 4)
    num_blocks = 1 + sum(full if w is None else cdiv(w - 1 + 16, 4) + 1 for w in model[1])
    llm = _engine(
        model, max_model_len=64, max_num_batched_tokens=16, num_gpu_blocks_override=num_blocks
    )
    prompts = random_prompts(6, 20, 40, seed=4)
    generate_and_check(llm, prompts, reference)
    assert llm.engine.get_stats().num_preemptions > 0


def test_window_groups_stop_growing(model, reference):
    """A long request: each window group holds at most the blocks its window spans plus
    the one being written; full-attention groups hold every block."""
    llm = _engine(model, max_num_batched_tokens=8)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    prompt = random_prompts(1, 30, 30, seed=5)[0]
    max_tokens = 60
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(EngineCoreRequest("long", prompt, params, 0.0))
    held: list[list[int]] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens.extend(out.new_token_ids)
        if engine.has_unfinished_requests():
            held.append([sum(b != 0 for b in ids) for ids in kv.get_block_ids("long")])
    assert tokens == reference(prompt, max_tokens)
    for group, window in enumerate(model[1]):
        most = max(step[group] for step in held)
        if window is None:  # what the step before the last computed (the last frees all;
            # with async scheduling, as on CUDA, one more token was in flight by then)
            assert most == cdiv(len(prompt) + max_tokens - 2 + engine.max_in_flight, 4)
        else:
            assert most <= cdiv(window - 1 + 8, 4) + 1
    assert kv.usage == 0.0
