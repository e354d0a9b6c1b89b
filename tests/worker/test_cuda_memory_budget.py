"""The KV cache budget on CUDA: gpu_memory_utilization is this instance's share (vLLM's
meaning), of the process's memory fraction, and never more than is free."""

from types import SimpleNamespace

import pytest
import torch

from worker.model_runner import ModelRunner

GIB = 1 << 30


@pytest.fixture
def fake_cuda(monkeypatch):
    """A 100 GiB GPU on which this process holds 10 GiB (weights) and allocated 4 GiB more
    at the profiling forward's peak; `state` sets what is free and the process fraction."""
    state = SimpleNamespace(free=90 * GIB, fraction=1.0)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (state.free, 100 * GIB))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: 14 * GIB)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device: 10 * GIB)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device: 10 * GIB)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device: state.fraction)
    return state


def budget(utilization: float) -> int:
    runner = SimpleNamespace(
        device=torch.device("cuda"),
        config=SimpleNamespace(gpu_memory_utilization=utilization),
        max_num_tokens=1000,
        _profile_forward=lambda n: (None, 2.0),
    )
    bytes_, seconds_per_token = ModelRunner._profile_cuda_memory(runner)
    assert seconds_per_token == pytest.approx(0.002)
    return bytes_


def test_alone_on_the_gpu(fake_cuda):
    assert budget(0.9) == 90 * GIB - 10 * GIB - 4 * GIB


def test_other_processes_are_not_charged_to_this_instance(fake_cuda):
    fake_cuda.free = 45 * GIB  # another engine holds 45 GiB
    assert budget(0.4) == 40 * GIB - 10 * GIB - 4 * GIB


def test_never_more_than_is_free(fake_cuda):
    fake_cuda.free = 20 * GIB
    assert budget(0.9) == 20 * GIB - 4 * GIB


def test_share_of_the_process_fraction(fake_cuda):
    fake_cuda.fraction = 0.25
    assert budget(0.8) == 20 * GIB - 10 * GIB - 4 * GIB
