"""Fixtures for cluster tests: tiny checkpoints, their transformers greedy answers, and
clusters started with launch.py (shared for the whole session: each costs seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.cluster.helpers import launch_cluster  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_path(tiny_checkpoint) -> str:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def llama_path(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def qwen3_tp2(qwen3_path, tmp_path_factory):
    """Two ranks with async scheduling forced on (CPU workers default to lockstep)."""
    folder = tmp_path_factory.mktemp("qwen3-tp2")
    with launch_cluster(folder, qwen3_path, "--tp", "2", "--async-scheduling") as c:
        yield c


@pytest.fixture(scope="session")
def llama_tp1(llama_path, tmp_path_factory):
    with launch_cluster(tmp_path_factory.mktemp("llama-tp1"), llama_path, "--tp", "1") as c:
        yield c


@pytest.fixture(params=[pytest.param("qwen3_tp2", marks=pytest.mark.gpus(2)), "llama_tp1"])
def cluster(request):
    """Each test runs on a 2-rank Qwen3 cluster (async scheduling) and a 1-rank Llama
    cluster (lockstep)."""
    return request.getfixturevalue(request.param)
