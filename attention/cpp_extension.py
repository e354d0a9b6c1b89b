"""Build-once loading of the project's C++ CPU kernels (torch.utils.cpp_extension).

Each kernel file lives beside the Python that calls it and is compiled the first time a
process asks for it, with -O3 -march=native and OpenMP, into a folder under the user
cache keyed by torch version, CPU flags (a native build never runs on another CPU) and
the sources; later processes load the cached library. Kernels may include cpu_math.h.
When there is no compiler, the build fails, or SPLITSERVE_CPU_KERNELS=0,
`load_cpp_extension` returns None after one warning and the caller falls back to its
torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SHARED_HEADER = Path(__file__).with_name("cpu_math.h")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def cpu_kernels_enabled() -> bool:
    return os.environ.get("SPLITSERVE_CPU_KERNELS", "1") not in ("0", "false", "no")


def _cpu_flags_digest() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def build_root() -> Path:
    base = os.environ.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve"
    version = torch.__version__.replace("+", "_")
    return Path(base) / "cpp_extensions" / f"torch-{version}-cpu-{_cpu_flags_digest()}"


def load_cpp_extension(name: str, *sources: Path) -> ModuleType | None:
    """The compiled module `name` built from `sources`, or None (with one warning) when it
    cannot be had. Concurrent processes wait for one build (torch's file lock)."""
    return _load(name, *sources) if cpu_kernels_enabled() else None


def _sources_digest(sources: tuple[Path, ...]) -> str:
    """Names a build by its sources' paths and contents, and those of the headers beside
    them and the shared header: ninja rebuilds whenever a source path changes, so two
    checkouts sharing one folder would rebuild each other's kernels on every switch."""
    digest = hashlib.sha1()
    headers = sorted({h for s in sources for h in Path(s).parent.glob("*.h")} | {SHARED_HEADER})
    for path in (*sources, *headers):
        digest.update(str(Path(path).resolve()).encode())
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:12]


@cache
def _load(name: str, *sources: Path) -> ModuleType | None:
    from torch.utils import cpp_extension

    build_dir = build_root() / name / _sources_digest(sources)
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja may come from the venv's `ninja` wheel, whose bin folder need not be on PATH.
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        warnings.warn(f"no C++ compiler: {name} runs on its torch fallback", stacklevel=2)
        return None
    if not any(build_dir.glob(f"{name}*.so")):
        logger.warning("building C++ kernels %s into %s (once; about a minute)", name, build_dir)
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=CFLAGS,
            extra_include_paths=[str(SHARED_HEADER.parent)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as e:  # a compiler error, a missing header: keep serving on torch
        message = f"C++ kernels {name} failed to build ({e}); using the torch fallback"
        warnings.warn(message, stacklevel=2)
        return None
