"""A ModelRunner over a tiny random Llama (fp32, 32 KV blocks of 8 tokens) for tests that
drive the runner with hand-made SchedulerOutputs."""

import pytest

from ipc.config import EngineConfig
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_checkpoint) -> ModelRunner:
    config = EngineConfig(
        model=tiny_checkpoint("llama"),
        dtype="float32",
        max_model_len=64,
        block_size=8,
        kv_cache_memory=1 << 20,
    )
    runner = ModelRunner(config)
    runner.initialize_kv_cache(32)
    return runner
