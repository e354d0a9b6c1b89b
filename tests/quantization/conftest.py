"""The quantized-kernel tests' fixtures: each ISA built here (tests/quantization/isas.py)
and the kernel module built for it."""

import pytest

from kernels import KernelSet
from models.quantization.cpu_quant_linear import quant_kernel
from tests.quantization.isas import kernel_isas


@pytest.fixture(params=kernel_isas())
def isa(request) -> str:
    return request.param


@pytest.fixture
def kernel(isa):
    module = quant_kernel(KernelSet(cpu=True, isa=isa))
    assert module is not None, f"the {isa} build failed"
    return module


@pytest.fixture
def exact_float32(monkeypatch):
    """float32 activations multiply quantized weights in float (SPLITSERVE_INT8_ACTIVATIONS=0),
    as the transformers reference does, for greedy tokens that must match it exactly."""
    monkeypatch.setenv("SPLITSERVE_INT8_ACTIVATIONS", "0")
