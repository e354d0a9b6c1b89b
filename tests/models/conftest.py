"""Fixtures for model tests; `tiny_checkpoint` is the factory of tests/models/tiny.py."""

from __future__ import annotations

import pytest

from tests.models.tiny import make_tiny_checkpoint


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """tiny_checkpoint(arch="llama", **config_overrides) -> checkpoint folder (str)."""

    def make(arch: str = "llama", **overrides) -> str:
        return make_tiny_checkpoint(tmp_path, arch, **overrides)

    return make
