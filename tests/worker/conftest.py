"""Shared fixtures: a ModelRunner over a tiny random Llama (fp32, 32 KV blocks of 8 tokens)
for tests that drive the runner with hand-made SchedulerOutputs, and `checkpoint`, a tiny
model with one KV cache group and one with two (a module's own `checkpoint` replaces it)."""

import pytest

from ipc.config import EngineConfig
from tests.models.tiny import make_tiny_checkpoint
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    config = EngineConfig(
        model=path, dtype="float32", max_model_len=64, block_size=8, kv_cache_memory=1 << 20
    )
    runner = ModelRunner(config)
    runner.initialize_kv_cache(32)
    return runner


# A Llama (one KV cache group) and a Qwen2 with two window layers (two groups, so two
# block tables and slot mappings per step).
CHECKPOINTS = {
    "llama": ("llama", {}),
    "qwen2-hybrid": (
        "qwen2",
        dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2),
    ),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> str:
    arch, overrides = CHECKPOINTS[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
