"""An in-process LLM gives its model and KV cache back on shutdown and when it is garbage
collected, so a second LLM in the same process finds the memory; also with async
scheduling (the default on CUDA), whose step thread must not keep the model alive."""

import weakref

import pytest

from splitserve import LLM, SamplingParams
from tests.worker.step_fakes import wait_until_collected


@pytest.fixture(params=[False, True], ids=["lockstep", "async"])
def async_scheduling(request) -> bool:
    return request.param


def _llm_and_refs(checkpoint: str, async_scheduling: bool) -> tuple[LLM, list[weakref.ref]]:
    """An LLM that has run a request, and weak references to its runner, model and every
    layer's KV cache."""
    llm = LLM(
        checkpoint,
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=16,
        async_scheduling=async_scheduling,
    )
    assert llm.engine.max_in_flight == int(async_scheduling)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    runner = llm.engine.executor.runner
    kv_caches = [layer.kv_cache for layer in runner.model.attention_layers()]
    assert kv_caches and all(kv is not None for kv in kv_caches)
    return llm, [weakref.ref(x) for x in (runner, runner.model, *kv_caches)]


def test_shutdown_frees_the_model_and_kv_cache(checkpoint, async_scheduling):
    llm, refs = _llm_and_refs(checkpoint, async_scheduling)
    llm.shutdown()
    assert [ref() for ref in refs] == [None] * len(refs)  # no garbage collection needed
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()  # a second shutdown is harmless


def test_garbage_collection_frees_the_model_and_kv_cache(checkpoint, async_scheduling):
    llm, refs = _llm_and_refs(checkpoint, async_scheduling)
    del llm
    wait_until_collected(refs)
    second, _ = _llm_and_refs(checkpoint, async_scheduling)
    second.shutdown()
