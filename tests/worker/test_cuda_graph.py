"""Decode batches padded to capture sizes (CudaGraphRunner in "padded_eager" mode, the
CUDA-graph code path minus the capture) against the plain eager step: same logits, same
KV cache, padding rows write nothing; prefills, mixed steps and big batches bypass it."""

import copy
import itertools
import time
from types import SimpleNamespace

import pytest
import torch

from attention.backends.torch_backend import TorchAttentionBackend
from attention.backends.triton_backend import TritonAttentionBackend
from engine_core import EngineConfig, EngineCore
from ipc.messages import EngineCoreRequest, SamplingParams
from splitserve.executor import InProcessExecutor
from tests.models.tiny import make_tiny_checkpoint
from worker.cuda_graph import CudaGraphRunner, capture_decode_graphs, default_capture_sizes
from worker.model_runner import ModelRunner

SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def test_default_capture_sizes():
    assert default_capture_sizes(256, 8192) == [1, 2, 4, *range(8, 257, 8)]
    assert default_capture_sizes(1000, 8192)[-1] == 512
    assert default_capture_sizes(12, 8192) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(256, 20) == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(3, 8192) == [1, 2, 4]
    assert default_capture_sizes(1, 8192) == [1]


def test_padded_size_is_the_smallest_capture_size_that_fits():
    runner = CudaGraphRunner(
        torch.nn.Identity(),
        None,
        [8, 1, 4, 2],
        max_model_len=64,
        max_num_blocks_per_req=4,
        hidden_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        mode="padded_eager",
    )
    assert [runner.padded_size(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


def test_config_rejects_bad_capture_sizes():
    for sizes in ([], [0, 8]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(max_model_len=64, cuda_graph_sizes=sizes)


def test_no_graphs_off_cuda(checkpoint):
    runner = ModelRunner(_config(checkpoint, "torch"))
    runner.initialize_kv_cache(8)
    assert runner.cuda_graphs is None


@pytest.mark.parametrize(
    ("enforce_eager", "backend"),
    [(True, TritonAttentionBackend()), (False, TorchAttentionBackend())],
)
def test_no_graphs_when_eager_is_enforced_or_the_backend_cannot(enforce_eager, backend):
    runner = SimpleNamespace(
        device=torch.device("cuda"),
        config=SimpleNamespace(enforce_eager=enforce_eager),
        attn_backend=backend,
    )
    assert capture_decode_graphs(runner) is None


def _config(checkpoint: str, backend: str) -> EngineConfig:
    return EngineConfig(
        model=checkpoint,
        dtype="float32",
        max_model_len=128,
        block_size=8,
        kv_cache_memory=1 << 20,
        max_num_seqs=10,
        attention_backend=backend,
        cuda_graph_sizes=SIZES,
    )


def _record_logits(runner: ModelRunner) -> list[torch.Tensor]:
    seen = []
    compute = runner.model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        seen.append(logits.clone())
        return logits

    runner.model.compute_logits = recording
    return seen


def _record_graph_runs(graphs: CudaGraphRunner) -> list[int]:
    seen = []
    run = graphs.run

    def recording(input_ids, positions, md):
        seen.append(md.num_actual_tokens)
        return run(input_ids, positions, md)

    graphs.run = recording
    return seen


def _kv_caches(runner: ModelRunner) -> list[torch.Tensor]:
    return [layer.kv_cache for layer in runner.model.attention_layers()]


def _assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to fp32 rounding, not bitwise: CPU GEMMs round differently for different
    row counts, and the padded metadata has the torch backend attend over max_model_len
    masked positions."""
    assert (actual - expected).abs().max().item() <= 1e-5


def _written_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> int:
    """Number of (block, offset) slots whose K or V changed in any layer."""
    changed = sum((b != a).any(dim=(0, 3, 4)) for b, a in zip(before, after, strict=True))
    return int(changed.bool().sum())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_matches_eager(checkpoint, backend):
    """One scheduler drives an eager runner and a padded one through the same steps.
    Requests finishing one per step give decode batches of 10 and 9 (eager: past the
    largest size), 8, 7 and 6 (padded to 8), then a late prompt makes a mixed step
    (eager), then 5 (padded to 8), 4, 3 (padded to 4), 2 and 1. Rows left in the static
    buffers by a bigger batch become the next smaller batch's padding."""
    config = _config(checkpoint, backend)
    core = EngineCore(config, InProcessExecutor(config))
    eager = core.executor.runner
    padded = ModelRunner(config)
    padded.initialize_kv_cache(_kv_caches(eager)[0].shape[1])
    padded.cuda_graphs = CudaGraphRunner.for_model_runner(padded, mode="padded_eager")
    padded.cuda_graphs.capture()
    eager_logits, padded_logits = _record_logits(eager), _record_logits(padded)
    graph_runs = _record_graph_runs(padded.cuda_graphs)

    gen = torch.Generator().manual_seed(0)
    for i in range(10):
        prompt_len = int(torch.randint(3, 20, (1,), generator=gen))
        prompt = torch.randint(0, 256, (prompt_len,), generator=gen)
        params = SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
        core.add_request(EngineCoreRequest(str(i), prompt.tolist(), params, time.time()))

    expected_runs = []
    for step in itertools.count():
        if not core.has_unfinished_requests():
            break
        if step == 6:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            core.add_request(EngineCoreRequest("late", list(range(5)), params, time.time()))
        so = core.scheduler.schedule()
        lens = list(so.num_scheduled_tokens.values())
        before = [kv.clone() for kv in _kv_caches(padded)]
        padded_out = padded.execute_model(copy.deepcopy(so))
        eager_out = eager.execute_model(so)
        core.scheduler.update_from_output(so, eager_out)

        assert padded_out.sampled_token_ids == eager_out.sampled_token_ids
        _assert_near(padded_logits[-1], eager_logits[-1])
        for p, e in zip(_kv_caches(padded), _kv_caches(eager), strict=True):
            _assert_near(p, e)
        if set(lens) == {1}:
            assert _written_slots(before, _kv_caches(padded)) == len(lens)
            if len(lens) <= SIZES[-1]:
                expected_runs.append(len(lens))
        assert graph_runs == expected_runs
    assert sorted(set(expected_runs)) == [1, 2, 3, 4, 5, 6, 7, 8]
