import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # the EngineCore-side tests need no torch
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
# Without a GPU the Triton kernels run on the CPU interpreter; it must be set before
# triton is imported. With one they run natively, on CUDA tensors (see `kernel_device`).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The project's packages and `tests.*` helpers import however pytest was started.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if HAS_CUDA and workers > 1:
        # pytest-xdist workers on one GPU: each gets an equal share of its memory, which
        # an engine's gpu_memory_utilization applies to (ModelRunner._profile_cuda_memory).
        torch.cuda.set_per_process_memory_fraction(1 / workers)
    config.addinivalue_line(
        "markers",
        "gpus(n): needs n CUDA devices when CUDA is in use (skipped on a machine with fewer; "
        "CPU runs, with any number of gloo ranks, are unaffected)",
    )


# Test folders that load no C++ kernel.
_NO_KERNELS = ("kv_cache", "engine_core", "ipc")


def pytest_collection_finish(session):
    """Build the C++ kernels the tests load, for the ISAs they load them for, several at
    once before the first test: on a fresh clone that halves the time spent compiling,
    and each xdist worker starting on another rung takes about a quarter off the rest.
    Every module for generic, AVX2 and this CPU's own rung; for another rung between them
    that a test forces (a parameter naming it), the modules other than the quantized ones,
    which are tested on those three alone (tests/quantization/isas.py)."""
    tests = Path(__file__).parent
    folders = {Path(item.path).relative_to(tests).parts[0] for item in session.items}
    if torch is None or folders <= set(_NO_KERNELS):
        return
    from kernels import KernelSet
    from kernels.isa import probe_isa, rungs
    from tests.quantization.isas import kernel_isas

    every_module = kernel_isas()  # generic, AVX2 and this CPU's own rung
    named = {
        value
        for item in session.items
        if hasattr(item, "callspec")
        for value in item.callspec.params.values()
        if isinstance(value, str)
    }
    forced = [rung for rung in rungs(probe_isa()) if rung in named and rung not in every_module]
    builds = every_module + forced
    # Each pytest-xdist worker starts on another rung: the builds then run side by side
    # (a build alone leaves a core idle while its header is precompiled and while its
    # longest file compiles), and a worker that reaches a rung being built waits for it.
    start = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]) % len(builds)
    for isa in builds[start:] + builds[:start]:
        kernels = KernelSet.for_device("cpu", os.environ | {"SPLITSERVE_CPU_ISA": isa})
        kernels.build(quantized=isa in every_module)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpus")
    if marker is not None and HAS_CUDA and torch.cuda.device_count() < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} CUDA devices, found {torch.cuda.device_count()}")


@pytest.fixture
def kernel_device() -> str:
    """Where the Triton kernel tests put their tensors: CUDA when there is a GPU, else the
    CPU (under TRITON_INTERPRET=1)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors gain nothing from threads, and on a shared 2-core box a parallel
    region can wait milliseconds for a descheduled thread."""
    if torch is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fake_tp(monkeypatch) -> Callable[[int, int], None]:
    """fake_tp(rank, size): layers built next take that tensor-parallel rank (their
    weight loaders only: no process group, no collectives)."""
    from models import parallel_state

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
        monkeypatch.setattr(parallel_state, "_TP_SIZE", size)

    return set_rank


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., str]:
    """tiny_checkpoint(name="llama", **config_overrides) -> the folder of a tiny random
    checkpoint: TINY_MODELS[name] of tests/models/tiny.py, or the arch `name`, with the
    overrides. Each is saved once per session: read it, never write into it."""
    from tests.models.tiny import TINY_MODELS, make_tiny_checkpoint

    paths: dict[tuple[str, str], str] = {}

    def path(name: str = "llama", **overrides) -> str:
        key = (name, repr(sorted(overrides.items())))
        if key not in paths:
            arch, defaults = TINY_MODELS.get(name, (name, {}))
            folder = tmp_path_factory.mktemp(name)
            paths[key] = make_tiny_checkpoint(folder, arch, name=name, **{**defaults, **overrides})
        return paths[key]

    return path


@pytest.fixture(scope="module")
def checkpoint(request, tiny_checkpoint) -> str:
    """A tiny random checkpoint: the Llama, or the TINY_MODELS names a test is
    parametrized with: `@pytest.mark.parametrize("checkpoint", [...], indirect=True)`."""
    return tiny_checkpoint(getattr(request, "param", "llama"))
