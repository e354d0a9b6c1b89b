"""What the C++ kernels are built as: two libraries, one extension module each, whose
submodules are the kernel files (kernels/build.py says why). The lists are fixed, not
gathered from what a process imports, so that every process builds and loads the same
library; a kernel file's Python loads its submodule through the model's KernelSet
(`KernelSet.cpp(ATTENTION)`)."""

from __future__ import annotations

from pathlib import Path

from kernels.build import CppLibrary, CppModule

ROOT = Path(__file__).resolve().parents[1]
_LAYERS = ROOT / "models" / "layers"
_QUANTIZATION = ROOT / "models" / "quantization"

_BACKENDS = ROOT / "attention" / "backends"
ATTENTION = CppModule("attention", (_BACKENDS / "cpu_attn.cpp", _BACKENDS / "cpu_prefill.cpp"))
OPS = CppModule("ops", (_LAYERS / "cpu_ops.cpp",))
DENSE_LINEAR = CppModule("dense_linear", (_LAYERS / "cpu_dense_linear.cpp",))
BF16_LINEAR = CppModule(
    "bf16_linear", (_LAYERS / "cpu_bf16_linear.cpp",), only_on="avx512_bf16", not_on="amx"
)
AMX_LINEAR = CppModule("amx_linear", (_LAYERS / "cpu_linear.cpp",), only_on="amx")
MOE = CppModule("moe", (_LAYERS / "cpu_moe.cpp",))
SAMPLER = CppModule("sampler", (ROOT / "worker" / "sampler_cpu.cpp",))
DECODE_LOOP = CppModule("decode_loop", (ROOT / "models" / "cpu_decode_loop.cpp",))

QUANT_LINEAR = CppModule(
    "quant_linear",
    tuple(_QUANTIZATION / f"cpu_quant_{n}.cpp" for n in ("linear", "tiles", "strips")),
)
FP8_LINEAR = CppModule("fp8_linear", (_QUANTIZATION / "cpu_fp8_linear.cpp",))
QUANT_MOE = CppModule("quant_moe", (_QUANTIZATION / "cpu_quant_moe.cpp",))

KERNELS = CppLibrary(
    "splitserve_kernels",
    ROOT / "kernels" / "bindings" / "kernels.cpp",
    (ATTENTION, OPS, DENSE_LINEAR, BF16_LINEAR, AMX_LINEAR, MOE, SAMPLER, DECODE_LOOP),
)
QUANT_KERNELS = CppLibrary(
    "splitserve_quant_kernels",
    ROOT / "kernels" / "bindings" / "quant_kernels.cpp",
    (QUANT_LINEAR, FP8_LINEAR, QUANT_MOE),
    quantized=True,
)
LIBRARIES = (KERNELS, QUANT_KERNELS)


def library_of(module: CppModule) -> CppLibrary:
    """The library that binds `module`."""
    return next(lib for lib in LIBRARIES if module in lib.modules)
