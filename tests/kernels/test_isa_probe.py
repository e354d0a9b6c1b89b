"""The ISA probe, the forced-ISA switch and the flags a build gets (kernels/isa.py), and the
KernelSet read from the environment (kernels/kernel_set.py)."""

import platform
import threading
from pathlib import Path

import pytest
import torch

import kernels.build
from kernels import KernelSet, check_isa, probe_isa
from kernels.build import CppLibrary, CppModule
from kernels.isa import compiler_flags, cpu_vendor, includes, ladder, machine, rungs, runnable_isas
from kernels.libraries import ATTENTION, KERNELS, LIBRARIES

X86_BASE = frozenset(
    [
        "avx",
        "avx2",
        "fma",
        "bmi1",
        "bmi2",
        "f16c",
        "movbe",
        "abm",
        "xsave",
        "cx16",
        "lahf_lm",
        "popcnt",
        "sse4_1",
        "sse4_2",
        "ssse3",
    ]
)
AVX512 = frozenset(["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"])
BF16 = frozenset(["avx512_bf16", "avx512_vnni"])
SAPPHIRE_RAPIDS = X86_BASE | AVX512 | BF16 | {"amx_tile", "amx_bf16", "amx_int8", "avx_vnni"}
ALDER_LAKE = X86_BASE | {"avx_vnni"}
on_x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")


@pytest.mark.parametrize(
    "flags, isa",
    [
        (SAPPHIRE_RAPIDS, "amx"),
        (SAPPHIRE_RAPIDS - {"amx_tile"}, "avx512_bf16"),
        (X86_BASE | AVX512 | BF16, "avx512_bf16"),
        (X86_BASE | AVX512 | BF16 | {"avx_vnni"}, "avx512_bf16"),  # Zen 5
        (ALDER_LAKE, "avx2_vnni"),
        (ALDER_LAKE - {"fma"}, "generic"),
        (X86_BASE | AVX512 | {"avx512_bf16"}, "avx512"),  # no VNNI
        (X86_BASE | AVX512, "avx512"),
        (X86_BASE | AVX512 - {"avx512vl"} | BF16 | {"amx_tile", "amx_bf16"}, "avx2"),
        (X86_BASE, "avx2"),
        (X86_BASE - {"fma"} | AVX512, "generic"),
        (frozenset({"sse2"}), "generic"),
    ],
)
def test_probe_climbs_the_x86_ladder_while_every_flag_is_there(flags, isa):
    assert probe_isa(flags, "x86_64") == isa


def test_probe_on_other_machines():
    assert probe_isa(frozenset({"fp", "asimd"}), "aarch64") == "neon"
    assert probe_isa(frozenset({"fp", "asimd", "asimddp"}), "aarch64") == "neon_dotprod"
    assert probe_isa(frozenset(), "riscv64") == "generic"
    assert ladder("aarch64") == ("generic", "neon", "neon_dotprod")
    assert rungs("neon_dotprod", "aarch64") == ("generic", "neon", "neon_dotprod")


def test_this_cpu_is_probed_onto_its_ladder():
    assert probe_isa() in ladder()
    assert runnable_isas()[-1] == probe_isa()
    assert set(rungs(probe_isa())) <= set(runnable_isas())


@on_x86
def test_avx_vnni_is_a_side_branch_above_avx2():
    assert rungs("avx2_vnni") == ("generic", "avx2", "avx2_vnni")
    assert rungs("amx") == ("generic", "avx2", "avx512", "avx512_bf16", "amx")
    assert includes("avx2_vnni", "avx2") and not includes("avx2_vnni", "avx512")
    assert not includes("amx", "avx2_vnni")
    assert runnable_isas("avx512") == ("generic", "avx2", "avx512")


@on_x86
def test_a_forced_isa_must_be_the_cpus_or_lower():
    assert check_isa("avx2", native="avx512") == "avx2"
    assert check_isa("avx512", native="avx512") == "avx512"
    with pytest.raises(ValueError, match="not one this CPU .'avx2'. runs.*: generic, avx2$"):
        check_isa("avx512", native="avx2")
    with pytest.raises(ValueError, match="'avx2_vnni' is not one this CPU .'avx512'. runs"):
        check_isa("avx2_vnni", native="avx512")
    with pytest.raises(ValueError, match="'sse9' is not one of .*: generic, avx2, avx2_vnni, "):
        check_isa("sse9", native="amx")


@on_x86
def test_each_isa_builds_with_its_march_and_the_macros_of_its_rungs():
    assert compiler_flags("generic") == ["-march=x86-64", "-mtune=native"]
    avx2 = compiler_flags("avx2")
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(avx2) and avx2[0] == "-march=x86-64"
    assert [flag for flag in avx2 if flag.startswith("-D")] == ["-DSPLITSERVE_AVX2"]
    assert not any("avx512" in flag for flag in avx2)
    amx = compiler_flags("amx")
    assert set(avx2) - {"-DSPLITSERVE_AVX2"} <= set(amx)
    assert {"-mavx512f", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"} <= set(amx)
    macros = [flag for flag in amx if flag.startswith("-D")]
    assert macros == [f"-DSPLITSERVE_{rung}" for rung in ("AVX2", "AVX512", "AVX512_BF16", "AMX")]
    assert "-mavxvnni" not in amx
    vnni = compiler_flags("avx2_vnni")
    assert set(avx2) - {"-DSPLITSERVE_AVX2"} | {"-mavxvnni"} <= set(vnni)
    assert not any("avx512" in flag for flag in vnni)
    assert [flag for flag in vnni if flag.startswith("-D")] == [
        "-DSPLITSERVE_AVX2",
        "-DSPLITSERVE_AVX2_VNNI",
    ]


def test_the_environment_gives_the_set_of_a_device():
    native = probe_isa()
    assert KernelSet.for_device("cpu", {}) == KernelSet(cpu=True, triton=False, isa=native)
    assert KernelSet.for_device(torch.device("cuda", 1), {}) == KernelSet(triton=True)
    assert not KernelSet.for_device("cpu", {"SPLITSERVE_CPU_KERNELS": "0"}).cpu
    assert not KernelSet.for_device("cuda", {"SPLITSERVE_TRITON_KERNELS": "false"}).triton
    assert KernelSet.for_device("cpu", {}).int8_activations
    assert not KernelSet.for_device("cpu", {"SPLITSERVE_INT8_ACTIVATIONS": "0"}).int8_activations
    generic = KernelSet.for_device("cpu", {"SPLITSERVE_CPU_ISA": " Generic "})
    assert generic.isa == "generic" and generic.cpu


def test_a_forced_isa_the_cpu_lacks_is_refused_at_start():
    lacked = [isa for isa in ladder() if isa not in runnable_isas()] or ["sse9"]
    with pytest.raises(ValueError, match=f"'{lacked[0]}'"):
        KernelSet.for_device("cpu", {"SPLITSERVE_CPU_ISA": lacked[0]})
    with pytest.raises(ValueError, match="'sse9' is not one of"):
        KernelSet(cpu=True, isa="sse9")


def test_a_set_says_which_isas_it_includes():
    generic = KernelSet(cpu=True, isa="generic")
    assert generic.has("generic") and not generic.has("neon") and not generic.has("amx")
    native = KernelSet(cpu=True)
    assert all(native.has(isa) for isa in rungs(native.isa))


def test_a_set_without_cpu_kernels_builds_none():
    assert KernelSet().cpp(ATTENTION) is None


def test_a_library_builds_the_modules_of_its_isa():
    main, extra = Path("bind.cpp"), CppModule("main", (Path("main.cpp"),))
    amx = CppModule("amx", (Path("amx.cpp"),), only_on="amx")
    below_amx = CppModule("bf16", (Path("bf16.cpp"),), only_on="avx512_bf16", not_on="amx")
    library = CppLibrary("lib", main, (extra, amx, below_amx))
    assert library.sources("generic") == (main, Path("main.cpp"))
    if machine() == "x86_64":
        assert set(library.sources("avx512_bf16")) == {main, Path("main.cpp"), Path("bf16.cpp")}
        assert set(library.sources("amx")) == {main, Path("main.cpp"), Path("amx.cpp")}
    assert KernelSet(cpu=True, isa="generic").cpp(amx) is None  # not even loaded


def test_build_makes_the_header_then_both_libraries_at_once(monkeypatch):
    both_running = threading.Barrier(2, timeout=10)  # broken unless two builds overlap
    events = []

    def load(name, sources, isa):
        events.append((name, isa))
        both_running.wait()

    monkeypatch.setattr(kernels.build, "load_cpp_extension", load)
    monkeypatch.setattr(kernels.build, "_precompiled_header", lambda isa, _: events.append(isa))
    KernelSet(cpu=True, isa="generic").build()
    assert events[0] == "generic", "the header is made first"
    assert sorted(events[1:]) == [(lib.name, "generic") for lib in LIBRARIES]
    events.clear()
    KernelSet(cpu=False, isa="generic").build()
    assert events == []


def test_build_leaves_the_quantized_kernels_to_quantized_models(monkeypatch):
    built = []
    monkeypatch.setattr(kernels.build, "load_cpp_extension", lambda name, *_: built.append(name))
    monkeypatch.setattr(kernels.build, "_precompiled_header", lambda *a: None)
    KernelSet(cpu=True, isa="generic").build(quantized=False)
    assert built == [KERNELS.name]
    built.clear()
    KernelSet(cpu=True, isa="generic").build(quantized=True)
    assert sorted(built) == sorted(lib.name for lib in LIBRARIES)


def test_the_vendor_is_read_with_the_flags():
    vendor = cpu_vendor()
    assert vendor in ("GenuineIntel", "AuthenticAMD") or machine() != "x86_64" or not vendor
    assert KernelSet().float32_gemm == (vendor != "GenuineIntel")
