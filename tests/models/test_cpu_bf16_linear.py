"""The bf16 linear kernel of AVX-512 BF16 CPUs without AMX (models/layers/cpu_bf16_linear.cpp)
against a float64 reference: rows 0 to 64, sizes off the 32-wide steps and 32-feature
items, strided rows, bias in bf16 and float32; what it declines (F.linear runs); and the
layers taking it. Built at avx512_bf16, forced on an AMX CPU; skipped below."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import KernelSet, probe_isa
from kernels.isa import includes
from models.layers.cpu_linear import (
    bf16_linear_kernel,
    dense_linear_kernel,
    linear,
    pack_weight,
)

HAS_BF16 = includes(probe_isa(), "avx512_bf16")
pytestmark = pytest.mark.skipif(not HAS_BF16, reason="no AVX-512 BF16 on this CPU")


@pytest.fixture(scope="module")
def bf16_set() -> KernelSet:
    """Made in a fixture: a CPU below the rung refuses the KernelSet (at collection, it
    would fail the run rather than skip the file)."""
    return KernelSet(cpu=True, isa="avx512_bf16")


@pytest.fixture(scope="module")
def ops(bf16_set):
    module = bf16_linear_kernel(bf16_set)
    assert module is not None, "the avx512_bf16 build failed"
    return module


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """Within one bf16 rounding of the exact product (+ bias) and float32 summation error."""
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact += bias.double()
    scale = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + scale * 1e-6 + 1e-30).all()


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 16, 33, 64])
@pytest.mark.parametrize(("k", "n"), [(72, 7), (576, 97), (1536, 64)], ids=str)
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32], ids=str)
def test_matches_float64(ops, rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = None if bias is None else torch.randn(n, generator=g).to(bias)
    check(ops.dense_linear(x, w, b), x, w, b)


def test_strided_rows_and_what_it_declines(ops):
    w = torch.randn(40, 96).bfloat16()
    wide = torch.randn(5, 200).bfloat16()
    check(ops.dense_linear(wide[:, 8:104], w, None), wide[:, 8:104], w, None)
    x = torch.randn(3, 96).bfloat16()
    assert ops.dense_linear(torch.randn(65, 96).bfloat16(), w, None) is None  # F.linear's
    assert ops.dense_linear(x.float(), w, None) is None
    assert ops.dense_linear(x, w.float(), None) is None
    assert ops.dense_linear(x.half(), w.half(), None) is None
    assert ops.dense_linear(x, w.t().contiguous().t(), None) is None
    assert ops.dense_linear(x[:, ::2], w[:, :48].contiguous(), None) is None
    assert ops.dense_linear(x, w, torch.randn(39).bfloat16()) is None


def test_layers_take_it_for_bf16_weights_and_fall_back_beyond_64_rows(ops, bf16_set):
    """bf16 weights: this kernel up to 64 rows, F.linear beyond; float32 weights: the
    float32-math kernel (cpu_dense_linear.cpp), as on every CPU."""
    w = torch.randn(64, 128).bfloat16()
    packed = pack_weight(w, bf16_set)
    assert packed is not None and packed.kernel is ops and not packed.amx
    assert pack_weight(w.float(), bf16_set).kernel is dense_linear_kernel(bf16_set)
    for rows in (2, 64, 65, 300):
        x = torch.randn(rows, 128).bfloat16()
        out = linear(x, w, None, packed)
        torch.testing.assert_close(out.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)
