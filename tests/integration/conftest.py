"""The windowed-model parity modules' fixtures. Such a module maps tiny checkpoint names to
the windows their KV cache groups get (GROUP_WINDOWS) and runs its tests over them:
`pytestmark = pytest.mark.parametrize("model", sorted(GROUP_WINDOWS), indirect=True)`."""

import pytest

from tests.integration.greedy import greedy_reference


@pytest.fixture(scope="module")
def model(request, tiny_checkpoint) -> tuple[str, list[int | None]]:
    """(the checkpoint's folder, its KV cache groups' windows)."""
    return tiny_checkpoint(request.param), request.module.GROUP_WINDOWS[request.param]


@pytest.fixture(scope="module")
def reference(model):
    return greedy_reference(model[0])
