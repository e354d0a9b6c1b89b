"""A ModelRunner over a tiny random Llama (fp32, 32 KV blocks of 8 tokens), shared by the
tests of one module that drive the runner with hand-made SchedulerOutputs."""

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
