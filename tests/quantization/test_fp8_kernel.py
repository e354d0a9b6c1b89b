"""The fp8 weight-only CPU kernel against the torch reference (dequantize, then F.linear),
on each ISA's build; and the fp8 matmul path against fp8 arithmetic done by hand."""

import pytest
import torch
import torch.nn.functional as F

from kernels import KernelSet
from models.quantization.cpu_fp8_linear import (
    FP8_DTYPE,
    SMALL_BATCH_ROWS,
    Fp8Weight,
    fp8_kernel,
    fp8_linear,
    prepare_fp8_weight,
    quantize_fp8_per_channel,
    torch_fp8_linear,
)
from models.quantization.fp8 import scaled_mm_linear
from tests.quantization.isas import kernel_isas

ISAS = kernel_isas()  # the own rung of an AVX-512 machine takes the AVX-512 path


def random_fp8(n: int, k: int, seed: int = 0) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_per_channel(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))


@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_is_exact_for_every_byte(isa):
    kernel = fp8_kernel(KernelSet(cpu=True, isa=isa))
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # all but the two NaNs
    w = Fp8Weight(codes.view(FP8_DTYPE), torch.rand(codes.shape[0]) + 0.5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(kernel.dequantize(codes, w.scale, dtype), w.dequantize(dtype))
    wide = random_fp8(8, 96)
    assert torch.equal(
        kernel.dequantize(wide.weight.view(torch.uint8), wide.scale, torch.float32),
        wide.dequantize(),
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 3, 8, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 5])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (33, 200), (16, 31), (24, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_torch_reference(isa, rows, n, k, bias):
    prepared = prepare_fp8_weight(random_fp8(n, k), KernelSet(cpu=True, isa=isa))
    assert prepared.kernel is not None
    x = torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    expected = torch_fp8_linear(x, prepared.weight, b)
    torch.testing.assert_close(fp8_linear(x, prepared, b), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [2, SMALL_BATCH_ROWS + 1])
def test_kernel_keeps_16_bit_activations_dtype(isa, dtype, rows):
    prepared = prepare_fp8_weight(random_fp8(64, 96), KernelSet(cpu=True, isa=isa))
    x, b = torch.randn(1, rows, 96, dtype=dtype), torch.randn(64, dtype=dtype)
    out = fp8_linear(x, prepared, b)
    assert (out.dtype, tuple(out.shape)) == (dtype, (1, rows, 64))
    expected = F.linear(x.float(), prepared.weight.dequantize(), b.float())
    atol = 1e-2 * expected.abs().max().item()  # a 16-bit rounding of the largest output
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=atol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tp", [2, 4])
def test_kernel_on_tensor_parallel_shards(isa, tp):
    """A rank's rows (column parallel) and its input features (row parallel: a strided
    view) give that rank's share of the full product."""
    kernels = KernelSet(cpu=True, isa=isa)
    full = random_fp8(64, 128)
    x = torch.randn(4, 128)
    expected = torch_fp8_linear(x, full)
    rows, cols = 64 // tp, 128 // tp
    partial_sum = torch.zeros_like(expected)
    for rank in range(tp):
        row_shard = Fp8Weight(
            full.weight[rank * rows : (rank + 1) * rows], full.scale[rank * rows :][:rows]
        )
        out = fp8_linear(x, prepare_fp8_weight(row_shard, kernels))
        torch.testing.assert_close(out, expected[:, rank * rows : (rank + 1) * rows])
        col_shard = Fp8Weight(full.weight[:, rank * cols : (rank + 1) * cols], full.scale)
        assert not col_shard.weight.is_contiguous()
        x_shard = x[:, rank * cols : (rank + 1) * cols]
        partial_sum += fp8_linear(x_shard, prepare_fp8_weight(col_shard, kernels))
    torch.testing.assert_close(partial_sum, expected, rtol=1e-5, atol=1e-5)


def test_kernel_off_runs_the_torch_path():
    prepared = prepare_fp8_weight(random_fp8(16, 32), KernelSet())
    assert prepared.kernel is None
    x = torch.randn(2, 32)
    assert torch.equal(fp8_linear(x, prepared), torch_fp8_linear(x, prepared.weight))


def test_per_channel_quantization_rounds_to_the_nearest_e4m3():
    w = torch.randn(24, 64) * torch.rand(24, 1) * 5
    q = quantize_fp8_per_channel(w)
    assert q.weight.float().abs().amax(dim=1).eq(448).all()
    scaled = w / q.scale[:, None]
    # e4m3 has 3 mantissa bits: half a step is 2^-4 of the value (2^-10 below 2^-6).
    bound = (scaled.abs() * 2**-4).clamp_min(2**-10)
    assert ((q.weight.float() - scaled).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("static", [False, True])
def test_fp8_matmul_path_is_fp8_arithmetic(static):
    """scaled_mm_linear (the CUDA path) computes x quantized to e4m3 per tensor times the
    fp8 weight; torch._scaled_mm also runs on CPU tensors, which checks the arithmetic."""
    w = random_fp8(32, 64)
    x, b = torch.randn(5, 64), torch.randn(32)
    x_scale = torch.tensor(0.02) if static else x.abs().amax() / 448
    x_fp8 = (x / x_scale).clamp(-448, 448).to(FP8_DTYPE).float() * x_scale
    expected = F.linear(x_fp8, w.dequantize(), b)
    out = scaled_mm_linear(x, w, torch.tensor(0.02) if static else None, b)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
