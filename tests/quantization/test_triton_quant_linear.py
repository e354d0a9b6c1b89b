"""The Triton weight-only quantized matmul (on the GPU, or under TRITON_INTERPRET=1 without
one) against float64 F.linear on BlockQuantWeight.dequantize (and on scale * fp8 weight).

The activations and the stored integers are exact in the dot's inputs and the kernel sums in
float32, so the result is the exact product rounded once to x's dtype: within one unit of
rounding, plus float32 summation error. Shapes are small (the interpreter is slow); N = 40
is no multiple of any tile, M = 1, 5 take the decode tiles and M = 33 the general ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.quantization.block_quant import BlockQuantWeight, pack_int4
from models.quantization.triton_quant_linear import triton_fp8_linear, triton_quant_linear

HAS_CUDA = torch.cuda.is_available()
# The interpreter's tl.dot mishandles bfloat16 (it multiplies the raw bits).
X_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def random_weight(
    bits: int, n: int, k: int, block_size: int, mins: bool, scale_dtype: torch.dtype, seed: int
) -> BlockQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    blocks = (n, k // block_size)
    scales = (torch.rand(blocks, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    low = (torch.randn(blocks, generator=gen) * 0.05).to(scale_dtype) if mins else None
    return BlockQuantWeight(bits, qweight, scales, low, block_size)


def on(w: BlockQuantWeight, device: str) -> BlockQuantWeight:
    mins = None if w.mins is None else w.mins.to(device)
    return BlockQuantWeight(w.bits, w.qweight.to(device), w.scales.to(device), mins, w.block_size)


def assert_rounded_exact(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """out is x @ weight^T + bias (weight float64 [N, K]) rounded to x's dtype."""
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], weight.shape[0])
    x64, out64 = x.cpu().double(), out.cpu().double()
    b64 = None if bias is None else bias.cpu().double()
    expected = F.linear(x64, weight, b64)
    magnitude = F.linear(x64.abs(), weight.abs(), None if b64 is None else b64.abs())
    bound = torch.finfo(x.dtype).eps * expected.abs() + 1e-5 * magnitude + 1e-30
    assert ((out64 - expected).abs() <= bound).all(), (out64 - expected).abs().max()


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("block_size", [16, 48, 96])
@pytest.mark.parametrize("mins", [False, True], ids=["scales", "mins"])
@pytest.mark.parametrize("bits", [4, 8])
def test_block_quant_matches_dequantized_linear(kernel_device, bits, mins, block_size, m):
    n, k = 40, 96
    w = random_weight(bits, n, k, block_size, mins, torch.float32, seed=bits + block_size + m)
    x = torch.randn(m, k).to(torch.float16)
    bias = torch.randn(n).to(torch.float16)
    out = triton_quant_linear(x.to(kernel_device), on(w, kernel_device), bias.to(kernel_device))
    assert_rounded_exact(out, x, w.dequantize().double(), bias)


@pytest.mark.parametrize("leading", [(2, 3), (3, 11)], ids=["decode", "general"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
def test_dtypes_leading_dims_and_a_narrowed_weight(kernel_device, x_dtype, scale_dtype, leading):
    """x [*leading, K] of each dtype (the tiles differ for float32); the weight a slice of
    input features of a wider one, so its rows (and its scales' rows) are strided."""
    whole = random_weight(4, 40, 192, 32, True, scale_dtype, seed=3)
    w = whole.narrow(1, 64, 64)
    assert w.qweight.stride(0) != w.qweight.shape[1]
    x = torch.randn(*leading, 64).to(x_dtype)
    out = triton_quant_linear(x.to(kernel_device), on(w, kernel_device))
    assert_rounded_exact(out, x, w.dequantize().double(), None)


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize(
    "scale_shape", [(40,), (40, 1), ()], ids=["channel", "channel2d", "tensor"]
)
def test_fp8_matches_scaled_linear(kernel_device, scale_shape, m):
    """K = 80 leaves a partial K step in both tile configurations."""
    gen = torch.Generator().manual_seed(m)
    weight = (torch.randn(40, 80, generator=gen) * 20).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=gen) + 0.01
    x = torch.randn(m, 80, generator=gen).to(torch.float16)
    bias = torch.randn(40, generator=gen).to(torch.float16)
    out = triton_fp8_linear(
        x.to(kernel_device),
        weight.to(kernel_device),
        scale.to(kernel_device),
        bias.to(kernel_device),
    )
    dequantized = weight.double() * scale.double().reshape(-1, 1)
    assert_rounded_exact(out, x, dequantized, bias)


def test_empty_batch_and_misfits(kernel_device):
    w = on(random_weight(8, 40, 64, 32, False, torch.float32, seed=0), kernel_device)
    empty = triton_quant_linear(torch.empty(0, 64, device=kernel_device), w)
    assert empty.shape == (0, 40)
    with pytest.raises(ValueError, match="does not fit"):
        triton_quant_linear(torch.randn(2, 32, device=kernel_device), w)
    with pytest.raises(ValueError, match="bias"):
        triton_quant_linear(torch.randn(2, 64, device=kernel_device), w, torch.zeros(39))
    fp8 = torch.zeros(40, 64, dtype=torch.float8_e4m3fn, device=kernel_device)
    with pytest.raises(ValueError, match="scale"):
        triton_fp8_linear(torch.randn(2, 64, device=kernel_device), fp8, torch.ones(3))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_larger_shape(kernel_device, bits):
    """Several K steps, M and N tiles of the general configuration, AWQ-sized groups."""
    w = random_weight(bits, 300, 512, 128, bits == 4, torch.float16, seed=bits)
    x = torch.randn(70, 512).to(torch.float16)
    out = triton_quant_linear(x.to(kernel_device), on(w, kernel_device))
    assert_rounded_exact(out, x, w.dequantize().double(), None)
