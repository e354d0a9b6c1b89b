"""Fixtures for model tests; `tiny_checkpoint` is the factory of tests/models/tiny.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# `tests.models.tiny` must import however pytest was started (plain `pytest` puts only
# the test folders on sys.path, `python -m pytest` also the working directory).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.models.tiny import make_tiny_checkpoint  # noqa: E402


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """tiny_checkpoint(arch="llama", **config_overrides) -> checkpoint folder (str)."""

    def make(arch: str = "llama", **overrides) -> str:
        return make_tiny_checkpoint(tmp_path, arch, **overrides)

    return make
