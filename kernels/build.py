"""Build-once loading of the project's C++ CPU kernels (torch.utils.cpp_extension).

The kernel files live beside the Python that calls them; they are built as two libraries,
one extension module each (kernels/libraries.py): the kernels every model may run and
those only quantized models run. A library is compiled the first time a process asks for
it for an ISA (kernels/isa.py: its flags, -O3 and OpenMP; only the files that ISA uses)
into a folder under the user cache keyed by torch version, machine, ISA and the sources;
later processes load the cached library. When there is no compiler or the build fails,
`load_cpp_extension` returns None after one warning and the callers fall back to their
torch paths. `build_all` builds both at once, ninja compiling each library's files in
parallel, once the precompiled header is made.

Only a library's binding file includes Python (kernels/python_module.h); every file first
includes torch_ext.h, ATen alone, which is precompiled once per ISA and torch version
(`_precompiled_header`) into a folder that comes first on every build's include path: gcc
takes the .gch there in place of parsing the header, and a compiler or flags it does not
fit (checked once as it is made) fall back to parsing. `build_all` makes the header before
the libraries' files; a file compiled while another process is making it parses the copy
in that folder (the same command line, so nothing rebuilds later).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from kernels.isa import compiler_flags, includes, machine

logger = logging.getLogger(__name__)

HEADERS = Path(__file__).parent
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def build_root(isa: str) -> Path:
    base = os.environ.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve"
    version = torch.__version__.replace("+", "_")
    return Path(base) / "cpp_extensions" / f"torch-{version}-{machine()}" / isa


@dataclass(frozen=True)
class CppModule:
    """A kernel file (or a few) of the project: the submodule `name` of the library that
    binds it, its sources, the ISA rung it is only built on (None: any) and the rung from
    which on it is not (None: none)."""

    name: str
    sources: tuple[Path, ...]
    only_on: str | None = None
    not_on: str | None = None

    def built_on(self, isa: str) -> bool:
        """Whether a build for `isa` has this module (its `only_on` and `not_on` rungs)."""
        return (self.only_on is None or includes(isa, self.only_on)) and not (
            self.not_on is not None and includes(isa, self.not_on)
        )


@dataclass(frozen=True)
class CppLibrary:
    """One extension module: its binding file (the only source that includes Python,
    kernels/python_module.h) and the kernel modules it binds as submodules; `quantized`: only
    quantized models load it (not built ahead for the others)."""

    name: str
    binding: Path
    modules: tuple[CppModule, ...]
    quantized: bool = False

    def sources(self, isa: str) -> tuple[Path, ...]:
        """What a build for `isa` compiles, the largest first (each is one compiler)."""
        return _library_sources(self, isa)


@cache
def _library_sources(library: CppLibrary, isa: str) -> tuple[Path, ...]:
    files = [library.binding, *(s for m in library.modules if m.built_on(isa) for s in m.sources)]
    return tuple(sorted(files, key=_source_bytes, reverse=True))


def build_all(libraries: Sequence[CppLibrary], isa: str) -> None:
    """Build (or load) `libraries` for `isa`: the precompiled header first, then the
    libraries at once (ninja compiles each one's files in parallel, as many as the CPU
    has cores), each file with the header made."""
    if not libraries:
        return
    _precompiled_header(isa, tuple(CFLAGS + compiler_flags(isa)))
    with ThreadPoolExecutor(len(libraries), thread_name_prefix="cpp-build") as pool:
        list(pool.map(lambda lib: load_cpp_extension(lib.name, lib.sources(isa), isa), libraries))


def _source_bytes(source: Path) -> int:
    """A source's size with the headers beside it: its compile time, roughly."""
    return sum(p.stat().st_size for p in (source, *source.parent.glob("*.h")) if p.exists())


def load_cpp_extension(name: str, sources: Sequence[Path], isa: str) -> ModuleType | None:
    """The module `name` built from `sources` for `isa`, or None (with one warning) when it
    cannot be had. Concurrent processes wait for one build (torch's file lock)."""
    return _load(name, tuple(Path(s).resolve() for s in sources), isa)


def _sources_digest(sources: tuple[Path, ...], flags: list[str]) -> str:
    """Names a build by its flags and its sources' paths and contents, and those of the
    headers beside them and here: ninja rebuilds whenever a source path changes, so two
    checkouts sharing one folder would rebuild each other's kernels on every switch."""
    digest = hashlib.sha1(" ".join(flags).encode())
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")} | set(HEADERS.glob("*.h")))
    for path in (*sources, *headers):
        digest.update(str(path.resolve()).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _torch_cflags(include: Path) -> list[str]:
    """The flags torch.utils.cpp_extension.load gives each file of a CPU extension, less
    its TORCH_EXTENSION_NAME (which torch_ext.h does not read), with `include` first."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include", "posix_prefix")]
    return [
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-I{include}",
        f"-I{HEADERS}",
        *(f"-isystem{path}" for path in includes),
        "-fPIC",
        "-std=c++20",
    ]


def _header_folder(isa: str, flags: tuple[str, ...]) -> Path:
    """The folder, first on every build's include path, that holds a copy of torch_ext.h
    and, once made, its precompiled form for these flags."""
    header = HEADERS / "torch_ext.h"
    key = hashlib.sha1(" ".join(flags).encode() + header.read_bytes()).hexdigest()[:12]
    folder = build_root(isa) / "precompiled" / key
    if not (folder / "torch_ext.h").exists():
        folder.mkdir(parents=True, exist_ok=True)
        copy = folder / f"torch_ext.h.{os.getpid()}.{threading.get_ident()}"
        shutil.copy2(header, copy)
        copy.replace(folder / "torch_ext.h")
    return folder


def _precompiled_header(isa: str, flags: tuple[str, ...]) -> Path | None:
    """The header folder with torch_ext.h.gch made there, by this call where no process
    is making it; None where another is (builds then parse the header, without waiting;
    a later call looks again) or gcc could not make one the builds would use (made once,
    checked in a folder of its own, moved in whole: a build never sees half a .gch)."""
    folder = _header_folder(isa, flags)
    gch, failed = folder / "torch_ext.h.gch", folder / "failed"
    with open(folder / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if gch.exists() or failed.exists():
            return folder if gch.exists() else None
        making = folder / "making"
        shutil.rmtree(making, ignore_errors=True)
        making.mkdir()
        shutil.copy2(folder / "torch_ext.h", making / "torch_ext.h")
        cxx = os.environ.get("CXX", "c++")
        cflags = [*_torch_cflags(making), *flags]
        logger.warning("precompiling torch's headers for the C++ kernels into %s", folder)
        made = subprocess.run(
            [
                cxx,
                *cflags,
                "-x",
                "c++-header",
                str(making / "torch_ext.h"),
                "-o",
                str(making / "torch_ext.h.gch"),
            ],
            capture_output=True,
        )
        probe = making / "probe.cpp"
        probe.write_text('#include "torch_ext.h"\n')
        check = ["-DTORCH_EXTENSION_NAME=probe", "-Winvalid-pch", "-Werror", "-fsyntax-only"]
        probed = subprocess.run([cxx, *cflags, *check, str(probe)], capture_output=True)
        if made.returncode == 0 and probed.returncode == 0:
            (making / "torch_ext.h.gch").replace(gch)
        else:
            failed.touch()  # not made again
        shutil.rmtree(making, ignore_errors=True)
        return folder if gch.exists() else None


@cache
def _load(name: str, sources: tuple[Path, ...], isa: str) -> ModuleType | None:
    from torch.utils import cpp_extension

    flags = CFLAGS + compiler_flags(isa)
    module_name = f"{name}_{isa}"  # each ISA's build is a module of its own
    build_dir = build_root(isa) / name / _sources_digest(sources, flags)
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja may come from the venv's `ninja` wheel, whose bin folder need not be on PATH.
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        warnings.warn(f"no C++ compiler: {name} runs on its torch fallback", stacklevel=2)
        return None
    if not any(build_dir.glob(f"{module_name}*.so")):
        logger.warning("building C++ kernels %s into %s (once; under a minute)", name, build_dir)
    _precompiled_header(isa, tuple(flags))  # made now, made already, or being made
    includes = [str(_header_folder(isa, tuple(flags))), str(HEADERS)]
    try:
        return cpp_extension.load(
            name=module_name,
            sources=[str(s) for s in sources],
            extra_cflags=flags,
            extra_include_paths=includes,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as e:  # a compiler error, a missing header: keep serving on torch
        message = f"C++ kernels {name} ({isa}) failed to build ({e}); using the torch fallback"
        warnings.warn(message, stacklevel=2)
        return None
