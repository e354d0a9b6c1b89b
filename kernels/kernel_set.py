"""The kernels a model runs, chosen once when it is loaded."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

import torch

from kernels.build import CppModule, build_all, load_cpp_extension
from kernels.isa import check_isa, cpu_vendor, forced_isa, includes, probe_isa
from kernels.libraries import LIBRARIES, library_of

_OFF = ("0", "false", "no")


@dataclass(frozen=True)
class KernelSet:
    """Which compiled kernels run: the C++ kernels on CPU tensors (`cpu`, built for `isa`)
    and the Triton kernels on CUDA tensors (`triton`); where one is off, or does not take a
    tensor, the torch code runs, which is also the reference both match. The worker makes
    one at model load (`for_device`, the only place the environment is read) and hands it
    to the model's layers, its attention backend and its sampler; each asks once for its
    C++ module (`cpp`, kernels/libraries.py) and keeps it. KernelSet() runs torch everywhere.
    `int8_activations`: the C++ linear layers on quantized weights quantize float32
    activations to int8 as they do 16-bit ones (off: float products, exact up to rounding).
    `decode_loop`: a Llama-style model's CPU decode steps run their layers in one C++ call
    (models/cpu_decode_loop.py; off: the Python layers, bitwise the same).
    `float32_gemm`: float32 weights take the C++ GEMM at every row count; off (Intel CPUs,
    where torch's float32 matmul is MKL's own code) from FLOAT32_GEMM_ROWS rows on they take
    F.linear (models/layers/cpu_linear.py)."""

    cpu: bool = False
    triton: bool = False
    isa: str = field(default_factory=probe_isa)
    int8_activations: bool = True
    decode_loop: bool = True
    float32_gemm: bool = field(default_factory=lambda: cpu_vendor() != "GenuineIntel")

    def __post_init__(self) -> None:
        check_isa(self.isa)

    @classmethod
    def for_device(
        cls, device: torch.device | str, environ: Mapping[str, str] = os.environ
    ) -> KernelSet:
        """The set of a model on `device`: the C++ kernels on a CPU, unless
        SPLITSERVE_CPU_KERNELS=0, built for SPLITSERVE_CPU_ISA (a lower ISA than this
        CPU's; default its own), float32 activations of quantized weights in int8 unless
        SPLITSERVE_INT8_ACTIVATIONS=0, a Llama-style decode step in one C++ call unless
        SPLITSERVE_CPU_DECODE_LOOP=0; the Triton kernels on CUDA, unless
        SPLITSERVE_TRITON_KERNELS=0."""
        device_type = torch.device(device).type
        forced = forced_isa(environ)
        return cls(
            cpu=device_type == "cpu" and _on(environ, "SPLITSERVE_CPU_KERNELS"),
            triton=device_type == "cuda" and _on(environ, "SPLITSERVE_TRITON_KERNELS"),
            isa=forced or probe_isa(),
            int8_activations=_on(environ, "SPLITSERVE_INT8_ACTIVATIONS"),
            decode_loop=_on(environ, "SPLITSERVE_CPU_DECODE_LOOP"),
        )

    def cpp(self, module: CppModule) -> ModuleType | None:
        """The C++ module built for this set's ISA (its library, loaded once per process);
        None when the C++ kernels are off, the ISA does not build it, or it cannot be
        built."""
        if not self.cpu or not self.uses(module):
            return None
        library = library_of(module)
        loaded = load_cpp_extension(library.name, library.sources(self.isa), self.isa)
        return None if loaded is None else getattr(loaded, module.name)

    def build(self, quantized: bool = True) -> None:
        """Build the C++ libraries for this set's ISA (the quantized models' one too, for a
        `quantized` model) at once, so that later `cpp` calls only load them."""
        if self.cpu:
            build_all([lib for lib in LIBRARIES if quantized or not lib.quantized], self.isa)

    def uses(self, module: CppModule) -> bool:
        """Whether this set's ISA builds `module` (its `only_on` and `not_on` rungs)."""
        return module.built_on(self.isa)

    def has(self, isa: str) -> bool:
        """Whether this set's ISA includes `isa` (e.g. "amx")."""
        return includes(self.isa, isa)


def _on(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "1").strip().lower() not in _OFF
