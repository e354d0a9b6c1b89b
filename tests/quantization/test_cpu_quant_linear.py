"""The block-quantized linear kernels (models/quantization/cpu_quant_linear.cpp) against
torch references, for every ISA this CPU can run (each built with the forced-ISA switch):
the exact float32 path against F.linear on the dequantized weight, the int8-activation
path against a reference that quantizes x the same way, the bf16 tile path against
F.linear on the weight dequantized to bf16, the prefill path bitwise against the torch
fallback. The kernels are always built here (a compiler is required)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import KernelSet
from models.quantization.block_quant import BlockQuantWeight
from models.quantization.cpu_quant_linear import (
    EXACT_ROWS,
    INT8_ROWS,
    TILE_ROWS,
    PreparedQuantWeight,
    prepare_quant_weight,
    quant_kernel,
    quant_linear,
    torch_quant_linear,
)
from tests.quantization.kernel_cases import LAYOUTS, args, int8_reference, magnitude, make_weight

EXACT_M = [1, 2, 3, 4, 5, 9]
INT8_M = [1, 2, 3, 4, 5, 8, 13, 64]
TILE_M = [1, 2, 5, 16, 17, 40, 64, 65, 130]  # tiles of 16 rows, chunks of 64


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mins", [False, True], ids=["no-mins", "mins"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "block_size"), LAYOUTS, ids=str)
def test_exact_path_matches_dequantize_then_linear(kernel, bits, mins, scale_dtype, k, block_size):
    w = make_weight(37, k, bits, block_size, mins, scale_dtype)
    bias = torch.randn(37)
    for m in EXACT_M:
        x = torch.randn(m, k)
        for b in (None, bias):
            out = kernel.linear_f32(x, *args(w), b)
            expected = F.linear(x, w.dequantize(), b)
            assert out.dtype == torch.float32 and out.shape == (m, 37)
            assert ((out - expected).abs() <= 1e-5 * magnitude(x, w) + 1e-6).all(), (m, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mins", [False, True], ids=["no-mins", "mins"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "block_size"), LAYOUTS, ids=str)
def test_int8_path_matches_its_reference(kernel, bits, mins, scale_dtype, dtype, k, block_size):
    w = make_weight(45, k, bits, block_size, mins, scale_dtype)
    bias = torch.randn(45).to(dtype)
    ulp = torch.finfo(dtype).eps
    for m in INT8_M:
        x = (torch.randn(m, k) * 2).to(dtype)
        x[0, :32] = 0  # an all-zero run: scale 0
        for b in (None, bias):
            out = kernel.linear_int8(x, *args(w), b)
            expected, xq = int8_reference(x, w, b)
            assert out.dtype == dtype and out.shape == (m, 45)
            tolerance = ulp * expected.abs() + 1e-5 * magnitude(xq, w) + 1e-6
            assert ((out.double() - expected).abs() <= tolerance).all(), (m, b)


def bf16_reference(x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None):
    """x times W dequantized to bf16, in float32: what the bf16 tile path rounds once."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.dequantize(torch.bfloat16).float(), b)


def within_bf16_rounding(out: torch.Tensor, x, w, reference: torch.Tensor) -> bool:
    tolerance = torch.finfo(torch.bfloat16).eps / 2 * reference.abs()
    tolerance += 1e-5 * magnitude(x, w).float() + 1e-6  # float32 sums in another order
    return bool(((out.float() - reference).abs() <= tolerance).all())


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mins", [False, True], ids=["no-mins", "mins"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "block_size"), LAYOUTS, ids=str)
def test_bf16_tile_path_matches_bf16_weight_then_linear(
    isa, kernel, bits, mins, scale_dtype, k, block_size
):
    """AMX tiles (amx) or vdpbf16ps (avx512_bf16); the builds below decline."""
    w = make_weight(48, k, bits, block_size, mins, scale_dtype)
    bias = torch.randn(48).bfloat16()
    for m in TILE_M:
        x = (torch.randn(m, k) * 2).bfloat16()
        for b in (None, bias):
            out = kernel.linear_bf16(x, *args(w), b)
            if not KernelSet(cpu=True, isa=isa).has("avx512_bf16"):
                assert out is None
                continue
            assert out.dtype == torch.bfloat16 and out.shape == (m, 48)
            assert within_bf16_rounding(out, x, w, bf16_reference(x, w, b)), (m, b)


def test_bf16_tile_path_declines_what_it_does_not_take(kernel):
    w = make_weight(32, 64, 4, 32, True, torch.float32)
    assert kernel.linear_bf16(torch.randn(2, 64).half(), *args(w)) is None  # float16 x
    assert kernel.linear_bf16(torch.randn(2, 64), *args(w)) is None
    assert kernel.linear_bf16(torch.randn(2, 128).bfloat16()[:, ::2], *args(w)) is None
    narrow = make_weight(40, 64, 4, 32, True, torch.float32)  # not strips of 16 features
    assert kernel.linear_bf16(torch.randn(2, 64).bfloat16(), *args(narrow)) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_quant_linear_takes_the_tile_path_for_its_rows(isa, threads):
    """bf16 x of TILE_ROWS rows: the tile kernel's result where the build has it; the int8
    or dequantizing paths (the rows they take) elsewhere."""
    torch.set_num_threads(threads)  # the conftest fixture restores it
    w = make_weight(64, 576, 4, 32, True, torch.float16)
    prepared = PreparedQuantWeight(w, quant_kernel(KernelSet(cpu=True, isa=isa)))  # in rows
    tiles = KernelSet(cpu=True, isa=isa).has("avx512_bf16")
    bias = torch.randn(64).bfloat16()
    for m in (TILE_ROWS.start - 1, TILE_ROWS.start, INT8_ROWS + 1, TILE_ROWS.stop - 1):
        x = torch.randn(m, 576).bfloat16()
        out = quant_linear(x, prepared, bias)
        if tiles and m in TILE_ROWS:
            assert torch.equal(out, prepared.kernel.linear_bf16(x, *args(w), bias)), m
            assert within_bf16_rounding(out, x, w, bf16_reference(x, w, bias)), m
        elif m <= INT8_ROWS:
            assert torch.equal(out, prepared.kernel.linear_int8(x, *args(w), bias)), m
        else:
            assert torch.equal(out, torch_quant_linear(x, w, bias)), m


def test_int8_path_quantizes_x_per_32_features(kernel):
    """A run of large values next to a run of small ones: per-run scales keep the small."""
    w = make_weight(16, 64, 8, 64, False, torch.float32)
    x = torch.cat([torch.full((1, 32), 1000.0), torch.randn(1, 32) * 1e-3], dim=1).bfloat16()
    x_small = x.clone()
    x_small[:, :32] = 0
    small = kernel.linear_int8(x_small, *args(w), None).double()
    expected = x_small.double() @ w.dequantize(torch.float64).T
    assert (small - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "int8_activations"),
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True), (torch.float16, True)],
    ids=["float32", "float32-exact", "bfloat16", "float16"],
)
@pytest.mark.parametrize(
    ("bits", "block_size", "mins", "scale_dtype"),
    [(4, 32, True, torch.float16), (8, 64, False, torch.float32), (4, 16, True, torch.float32)],
    ids=["q4_1", "q8-fp32-scales", "q4-16"],
)
def test_quant_linear_over_rows_and_threads(
    isa, dtype, int8_activations, threads, bits, block_size, mins, scale_dtype
):
    """Every path quant_linear picks by rows: int8 activations (the exact path for float32
    x when the kernel set asks for it), then exactly the torch fallback (the C++ dequantizes
    as BlockQuantWeight.dequantize)."""
    torch.set_num_threads(threads)  # the conftest fixture restores it
    w = make_weight(70, 576, bits, block_size, mins, scale_dtype)
    kernels = KernelSet(cpu=True, isa=isa, int8_activations=int8_activations)
    prepared = prepare_quant_weight(w, kernels)
    assert prepared.kernel is not None
    exact = not int8_activations
    bias = torch.randn(70).to(dtype)
    limit = EXACT_ROWS if exact else INT8_ROWS
    for m in (0, 1, limit, limit + 1, 300):
        x = torch.randn(m, 576).to(dtype)
        out = quant_linear(x, prepared, bias)
        expected = torch_quant_linear(x, w, bias)
        assert out.dtype == dtype and out.shape == (m, 70)
        if m > limit:
            assert torch.equal(out, expected), m
        elif exact:
            reference = F.linear(x, w.dequantize(), bias)
            assert ((out - reference).abs() <= 1e-5 * magnitude(x, w) + 1e-5).all(), m
        else:
            reference, xq = int8_reference(x, w, bias)
            tolerance = torch.finfo(dtype).eps * reference.abs() + 1e-5 * magnitude(xq, w) + 1e-5
            assert ((out.double() - reference).abs() <= tolerance).all(), m


def test_strided_x(kernel):
    """Rows apart in memory are read in place; features apart fall back to torch."""
    w = make_weight(33, 128, 4, 32, True, torch.float32)
    wide = torch.randn(5, 256)
    rows = wide[:, :128]
    assert torch.equal(kernel.linear_f32(rows, *args(w)), kernel.linear_f32(rows.clone(), *args(w)))
    assert kernel.linear_f32(wide[:, ::2], *args(w)) is None
    assert kernel.linear_int8(wide.bfloat16()[:, ::2], *args(w)) is None
    prepared = PreparedQuantWeight(w, kernel)
    strided = wide.bfloat16()[:, ::2]
    assert torch.equal(quant_linear(strided, prepared), torch_quant_linear(strided, w))


def test_the_kernels_decline_what_they_do_not_take(kernel):
    w = make_weight(16, 64, 4, 32, True, torch.float32)
    assert kernel.linear_int8(torch.randn(2, 64).double(), *args(w)) is None  # float64 x
    assert kernel.linear_f32(torch.randn(2, 64).bfloat16(), *args(w)) is None
    assert kernel.linear_f32(torch.randn(2, 96), *args(w)) is None  # K differs
    assert kernel.linear_f32(torch.randn(2, 64), *args(w), torch.randn(15)) is None  # bias
    q, s, m, bits, bs = args(w)
    assert kernel.linear_f32(torch.randn(2, 64), q.t().contiguous().t(), s, m, bits, bs) is None
    assert kernel.linear_f32(torch.randn(2, 64), q, s, m.half(), bits, bs) is None  # dtypes
    out = torch.empty(16, 64, dtype=torch.float64)
    assert not kernel.dequantize_into(out, *args(w))


@pytest.mark.parametrize(("dim", "start", "length"), [(0, 16, 50), (1, 128, 256), (1, 0, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_parallel_shards(isa, dim, start, length, dtype):
    """A shard (BlockQuantWeight.narrow: a strided view along dim 1) computes as its
    dequantized rows or columns do (int8 activations, decode rows)."""
    w = make_weight(96, 512, 4, 64, True, torch.float16).narrow(dim, start, length)
    prepared = prepare_quant_weight(w, KernelSet(cpu=True, isa=isa))
    assert prepared.kernel is not None and prepared.shape == w.shape
    x = torch.randn(3, w.shape[1]).to(dtype)
    out = quant_linear(x, prepared)
    reference, xq = int8_reference(x, w)
    tolerance = torch.finfo(dtype).eps * reference.abs() + 1e-5 * magnitude(xq, w) + 1e-5
    assert ((out.double() - reference).abs() <= tolerance).all()


def test_kernels_off_keep_the_weight_for_torch():
    w = make_weight(16, 64, 8, 64, False, torch.float32)
    prepared = prepare_quant_weight(w, KernelSet())
    assert prepared.kernel is None and prepared.weight is w
    x = torch.randn(2, 64).bfloat16()
    assert torch.equal(quant_linear(x, prepared), torch_quant_linear(x, w))


def test_a_cuda_weight_goes_to_triton_only_when_the_set_says(monkeypatch):
    import models.quantization.cpu_quant_linear as mod

    w = BlockQuantWeight(8, torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1), None, 32)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda")))
    on, off = (mod.prepare_quant_weight(w, KernelSet(triton=t)) for t in (True, False))
    assert (on.triton, on.kernel, off.triton, off.kernel) == (True, None, False, None)
