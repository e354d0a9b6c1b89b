import sys

import fake_flash_attn
import pytest
import torch

from attention import get_attn_backend
from kernels import KernelSet


def test_auto_on_cpu_is_the_cpp_kernels_else_torch():
    assert get_attn_backend(kernels=KernelSet(cpu=True)).name == "cpu"
    assert get_attn_backend("auto", torch.device("cpu"), kernels=KernelSet(cpu=True)).name == "cpu"
    assert get_attn_backend("auto", torch.device("cpu"), kernels=KernelSet()).name == "torch"


def test_the_kernels_default_to_the_environment_read_when_asked(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "0")
    assert get_attn_backend("auto", "cpu").name == "torch"
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "1")
    assert get_attn_backend("auto", "cpu").name == "cpu"


def test_auto_on_cuda_prefers_flash_attn_when_installed_and_supported(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)
    assert get_attn_backend("auto", "cuda").name == "flash_attn"
    assert get_attn_backend("auto", "cuda", block_size=256, dtype=torch.bfloat16).name == (
        "flash_attn"
    )
    assert get_attn_backend("auto", "cuda", block_size=16).name == "triton"
    assert get_attn_backend("auto", "cuda", dtype=torch.float32).name == "triton"


def test_auto_on_cuda_without_flash_attn_is_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    assert get_attn_backend("auto", "cuda:0").name == "triton"


def test_explicit_names():
    assert get_attn_backend("torch", "cpu").name == "torch"
    assert get_attn_backend("torch", "cuda").name == "torch"
    assert get_attn_backend("triton", "cuda:0").name == "triton"
    assert get_attn_backend("cpu", "cpu").name == "cpu"
    with pytest.raises(ValueError, match="CPU devices only"):
        get_attn_backend("cpu", "cuda")
    with pytest.raises(ValueError, match="auto, flash_attn, triton, cpu, torch"):
        get_attn_backend("xformers")
    with pytest.raises(ValueError, match="CUDA"):
        get_attn_backend("flash_attn", "cpu")


def test_explicit_flash_attn_checks(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ImportError, match="pip install flash-attn"):
        get_attn_backend("flash_attn", "cuda")
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)
    with pytest.raises(ValueError, match="multiple of 256"):
        get_attn_backend("flash_attn", "cuda", block_size=16)
    assert get_attn_backend("flash_attn", "cuda", block_size=512).name == "flash_attn"


def test_triton_needs_cuda():
    """Whatever the environment: tests that run the Triton backend on the interpreter
    build it themselves."""
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        get_attn_backend("triton", "cpu")
