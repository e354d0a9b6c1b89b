"""The public face's names: every name of `splitserve.__all__` is there, as vLLM spells it,
and `import splitserve` alone loads neither the engine, the clients nor torch (a worker
process imports splitserve's modules)."""

import subprocess
import sys

import pytest

import splitserve
from tests.import_graph import ROOT


@pytest.mark.parametrize("name", splitserve.__all__)
def test_every_public_name_is_there(name):
    assert getattr(splitserve, name).__name__ == name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        splitserve.Engine  # noqa: B018


def test_importing_splitserve_loads_no_engine_client_or_torch():
    probe = "import sys, splitserve; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = set(result.stdout.split())
    assert loaded & {"torch", "engine_core", "worker", "ipc.client", "splitserve.llm"} == set()
