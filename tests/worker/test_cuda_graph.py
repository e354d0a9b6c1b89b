"""Decode batches padded to capture sizes against the plain eager step: same logits, same
KV cache, padding rows write nothing; prefills, mixed steps and big batches bypass them.
On CPU the CudaGraphRunner runs in "padded_eager" mode (the CUDA-graph code path minus
the capture); on a GPU the Triton backend also replays real graphs."""

import copy
import itertools
import time

import pytest
import torch

from attention.backends.torch_backend import TorchAttentionBackend
from attention.backends.triton_backend import TritonAttentionBackend
from engine_core import EngineConfig, EngineCore
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams
from worker.buffers import InputBuffers
from worker.cuda_graph import (
    CudaGraphRunner,
    capture_sizes,
    cuda_graphs_off_reason,
    default_capture_sizes,
)
from worker.inproc_executor import InProcessExecutor
from worker.model_runner import ModelRunner

SIZES = [1, 2, 4, 8]


def test_default_capture_sizes():
    assert default_capture_sizes(256, 8192) == [1, 2, 4, *range(8, 257, 8)]
    assert default_capture_sizes(1000, 8192)[-1] == 512
    assert default_capture_sizes(12, 8192) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(256, 20) == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(3, 8192) == [1, 2, 4]
    assert default_capture_sizes(1, 8192) == [1]


def test_capture_sizes_stop_at_the_largest_decode_batch():
    """No captured batch has more rows than the persistent buffers hold."""
    assert capture_sizes(None, 12, 8192) == [1, 2, 4, 8, 12]
    assert capture_sizes(None, 256, 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes([64, 1, 3], 10, 8192) == [1, 3, 10]
    assert capture_sizes(None, 256, 8192) == default_capture_sizes(256, 8192)


def _graph_runner(sizes: list[int], max_num_reqs: int = 8) -> CudaGraphRunner:
    return CudaGraphRunner(
        torch.nn.Identity(),
        TorchAttentionBackend(),
        InputBuffers(max_num_reqs, 16, 4, torch.device("cpu")),
        [torch.zeros(max_num_reqs, 4, dtype=torch.int32)],
        sizes,
        max_model_len=64,
        hidden_size=4,
        dtype=torch.float32,
        mode="padded_eager",
    )


def test_padded_size_is_the_smallest_capture_size_that_fits():
    runner = _graph_runner([8, 1, 4, 2])
    assert [runner.padded_size(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


def test_capture_sizes_must_fit_the_buffers():
    with pytest.raises(ValueError, match="exceeds"):
        _graph_runner([1, 16], max_num_reqs=8)
    with pytest.raises(ValueError, match="positive"):
        _graph_runner([0, 8])


def test_config_rejects_bad_capture_sizes():
    for sizes in ([], [0, 8]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(max_model_len=64, cuda_graph_sizes=sizes)


def test_cuda_graphs_off_reason():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    assert cuda_graphs_off_reason(cuda, False, triton) is None
    assert "CUDA" in cuda_graphs_off_reason(cpu, False, triton)
    assert cuda_graphs_off_reason(cuda, True, triton) == "enforce_eager"
    assert "torch" in cuda_graphs_off_reason(cuda, False, torch_backend)


@pytest.mark.parametrize("checkpoint", ["llama", "qwen2-hybrid"], indirect=True)
def test_capture_is_an_explicit_step_after_the_kv_cache(checkpoint):
    runner = ModelRunner(_config(checkpoint, "torch"))
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        runner.capture_cuda_graphs()
    runner.initialize_kv_cache(8)
    assert runner.cuda_graphs is None  # initialize_kv_cache captures nothing
    runner.capture_cuda_graphs()
    if runner.device.type == "cpu":
        assert runner.cuda_graphs is None


def _config(checkpoint: str, backend: str, **overrides) -> EngineConfig:
    return EngineConfig(
        model=checkpoint,
        dtype="float32",
        max_model_len=128,
        block_size=8,
        num_gpu_blocks_override=128,
        max_num_seqs=10,
        attention_backend=backend,
        cuda_graph_sizes=SIZES,
        **overrides,
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


def _record_graph_runs(runner: ModelRunner) -> list[tuple[int, int]]:
    """(requests, padded size) of every step that runs through the CudaGraphRunner."""
    seen = []
    graphs = runner.cuda_graphs
    run = graphs.run

    def recording(size: int) -> torch.Tensor:
        seen.append((runner.input_batch.num_reqs, size))
        return run(size)

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


MODES = [
    ("torch", "padded_eager"),
    # Under the Triton interpreter (no GPU) about 22 s of the default set: marked slow.
    pytest.param("triton", "padded_eager", marks=pytest.mark.slow),
    pytest.param(
        "triton",
        "cuda_graph",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


@pytest.mark.parametrize("checkpoint", ["llama", "qwen2-hybrid"], indirect=True)
@pytest.mark.parametrize(("backend", "mode"), MODES)
def test_padded_decode_matches_eager(checkpoint, backend, mode, monkeypatch):
    """One scheduler drives an eager runner and a padded one through the same steps.
    Requests finishing one per step give decode batches of 10 and 9 (eager: past the
    largest size), 8, 7 and 6 (padded to 8), then a late prompt makes a mixed step
    (eager), then 5 (padded to 8), 4, 3 (padded to 4), 2 and 1. Rows left in the
    persistent buffers by a bigger batch become the next smaller batch's padding."""
    if backend == "triton":  # the selector offers it on CUDA only; the interpreter runs it here
        monkeypatch.setattr(
            "worker.model_runner.get_attn_backend", lambda *_, **__: TritonAttentionBackend()
        )
    eager_config = _config(checkpoint, backend, enforce_eager=True)
    core = EngineCore(eager_config, InProcessExecutor(eager_config))
    eager = core.executor.runner
    assert eager.cuda_graphs is None
    padded = ModelRunner(_config(checkpoint, backend))
    padded.initialize_kv_cache(_kv_caches(eager)[0].shape[1])
    padded.capture_cuda_graphs(mode)
    eager_logits, padded_logits = _record_logits(eager), _record_logits(padded)
    graph_runs = _record_graph_runs(padded)

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
            num_groups = len(padded.kv_cache_groups)
            assert _written_slots(before, _kv_caches(padded)) == len(lens) * num_groups
            if len(lens) <= SIZES[-1]:
                expected_runs.append((len(lens), padded.cuda_graphs.padded_size(len(lens))))
        assert graph_runs == expected_runs
    assert sorted({n for n, _ in expected_runs}) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert {size for _, size in expected_runs} == set(SIZES)
