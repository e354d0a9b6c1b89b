"""Block-quantized weights in strips of 8 features (models/quantization/strips.py) and the
AVX2 and AVX512-BF16 (VNNI) kernels on them (cpu_quant_strips.cpp): the layout against the
row layout byte by byte, each kernel against the row kernels and torch references, for
every ISA built; builds without the strip kernels (generic, AVX512F, AMX) decline them and
keep rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import KernelSet
from models.quantization.cpu_quant_linear import (
    STRIP_EXACT_ROWS,
    STRIP_INT8_ROWS_BF16,
    PreparedQuantWeight,
    prepare_quant_weight,
    quant_linear,
    torch_quant_linear,
)
from models.quantization.strips import StripQuantWeight, to_strips
from tests.quantization.kernel_cases import (
    LAYOUTS,
    args,
    int8_reference,
    magnitude,
    make_weight,
)


def strip_args(s: StripQuantWeight) -> tuple:
    return s.q, s.scales, s.mins, s.bits, s.block_size


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "block_size"), LAYOUTS, ids=str)
def test_strips_hold_the_rows_bytes_in_chunk_order(bits, k, block_size):
    w = make_weight(24, k, bits, block_size, True, torch.float16)
    s = to_strips(w)
    chunks = (16 if bits == 4 else 32) // 4
    q = s.q.reshape(3, k // 32, chunks, 8, 4)
    for n in (0, 9, 23):
        for run in range(k // 32):
            for c in range(chunks):
                at = run * chunks * 4 + 4 * c
                assert torch.equal(q[n // 8, run, c, n % 8], w.qweight[n, at : at + 4])
    assert torch.equal(s.scales[1, :, 3], w.scales[11]) and torch.equal(s.mins[2, :, 7], w.mins[23])
    back = s.row_weight()
    assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    assert torch.equal(back.mins, w.mins)
    ids = torch.tensor([5, 0, 23, 5])
    rows = s.rows(ids)
    assert torch.equal(rows.dequantize(), w.dequantize()[ids])


def test_only_whole_strips_are_regrouped():
    assert to_strips(make_weight(20, 64, 4, 32, False, torch.float32)) is None


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mins", [False, True], ids=["no-mins", "mins"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "block_size"), LAYOUTS, ids=str)
def test_strip_kernels_match_their_references(kernel, bits, mins, scale_dtype, k, block_size):
    """Exact: F.linear on the dequantized weight; int8: the int8 reference; dequantize:
    bitwise the row kernel's."""
    w = make_weight(48, k, bits, block_size, mins, scale_dtype)
    s = to_strips(w)
    bias = torch.randn(48)
    if not kernel.strip_width():
        assert kernel.strip_linear_f32(torch.randn(1, k), *strip_args(s)) is None
        assert kernel.strip_linear_int8(torch.randn(1, k).bfloat16(), *strip_args(s)) is None
        assert not kernel.strip_dequantize_into(torch.empty(48, k), *strip_args(s))
        return
    assert kernel.strip_width() == 8
    for m in (*range(1, 10), 17, 150):  # every pass of up to 8 rows, several passes and blocks
        x = torch.randn(m, k)
        for b in (None, bias):
            out = kernel.strip_linear_f32(x, *strip_args(s), b)
            expected = F.linear(x, w.dequantize(), b)
            assert ((out - expected).abs() <= 1e-5 * magnitude(x, w) + 1e-6).all(), (m, b)
            for dtype in (torch.float32, torch.bfloat16):
                xd, bd = (x * 2).to(dtype), None if b is None else b.to(dtype)
                xd[0, :32] = 0  # an all-zero run: scale 0
                out = kernel.strip_linear_int8(xd, *strip_args(s), bd)
                expected, xq = int8_reference(xd, w, bd)
                tolerance = torch.finfo(dtype).eps * expected.abs()
                tolerance += 1e-5 * magnitude(xq, w) + 1e-6
                assert out.dtype == dtype
                assert ((out.double() - expected).abs() <= tolerance).all(), (m, b, dtype)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        from_strips, from_rows = torch.empty(48, k, dtype=dtype), torch.empty(48, k, dtype=dtype)
        assert kernel.strip_dequantize_into(from_strips, *strip_args(s))
        assert kernel.dequantize_into(from_rows, *args(w))
        assert torch.equal(from_strips, from_rows)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "int8_activations"),
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True), (torch.float16, True)],
    ids=["float32", "float32-exact", "bfloat16", "float16"],
)
@pytest.mark.parametrize(
    ("bits", "block_size", "mins", "scale_dtype"),
    [(4, 32, True, torch.float16), (8, 64, False, torch.float32), (4, 48, True, torch.float32)],
    ids=["q4_1", "q8-fp32-scales", "q4-48"],
)
def test_quant_linear_on_strips(
    isa, dtype, int8_activations, threads, bits, block_size, mins, scale_dtype
):
    """A weight of whole strips is held in strips where the build computes on them, and every
    row count gives the strip kernels' answer: int8 at any rows (bfloat16 x, where torch's
    bf16 matmul is native, up to STRIP_INT8_ROWS_BF16); float32 x, when the kernel set asks
    for exact products, exact up to STRIP_EXACT_ROWS (past either, the torch fallback
    bitwise)."""
    torch.set_num_threads(threads)  # the conftest fixture restores it
    w = make_weight(80, 576, bits, block_size, mins, scale_dtype)
    kernels = KernelSet(cpu=True, isa=isa, int8_activations=int8_activations)
    prepared = prepare_quant_weight(w, kernels)
    exact = dtype == torch.float32 and not int8_activations
    strips = bool(prepared.kernel.strip_width())
    assert isinstance(prepared.weight, StripQuantWeight) == strips
    assert prepared.bf16_matmul == (strips and isa == "avx512_bf16")
    assert prepared.shape == w.shape
    bias = torch.randn(80).to(dtype)
    for m in (0, 1, STRIP_EXACT_ROWS, STRIP_EXACT_ROWS + 1, 300):
        x = torch.randn(m, 576).to(dtype)
        out = quant_linear(x, prepared, bias)
        assert out.dtype == dtype and out.shape == (m, 80)
        if not strips:
            continue
        dequantizes = m > STRIP_INT8_ROWS_BF16 and dtype == torch.bfloat16
        if (exact and m > STRIP_EXACT_ROWS) or (dequantizes and prepared.bf16_matmul):
            assert torch.equal(out, torch_quant_linear(x, w, bias)), m
        elif exact:
            reference = F.linear(x, w.dequantize(), bias)
            assert ((out - reference).abs() <= 1e-5 * magnitude(x, w) + 1e-5).all(), m
        elif m:
            expected, xq = int8_reference(x, w, bias)
            tolerance = 2 * torch.finfo(dtype).eps * expected.abs() + 1e-5 * magnitude(xq, w)
            assert ((out.double() - expected).abs() <= tolerance + 1e-5).all(), m


def test_a_prepared_weight_gives_back_its_rows(isa):
    w = make_weight(64, 128, 4, 32, True, torch.float16)
    prepared = prepare_quant_weight(w, KernelSet(cpu=True, isa=isa))
    back = prepared.row_weight()
    assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    ids = torch.tensor([63, 1, 1])
    assert torch.equal(prepared.rows(ids).dequantize(), w.dequantize()[ids])
    again = prepare_quant_weight(prepared, KernelSet(cpu=True, isa=isa))
    assert type(again.weight) is type(prepared.weight)
    off = prepare_quant_weight(prepared, KernelSet())
    assert off.kernel is None and torch.equal(off.weight.qweight, w.qweight)
    strided = torch.randn(3, 256).bfloat16()[:, ::2]  # the kernels decline: torch on the rows
    assert torch.equal(quant_linear(strided, prepared), torch_quant_linear(strided, w))
    unbound = PreparedQuantWeight(prepared.weight, None)
    x = torch.randn(2, 128)
    assert torch.equal(quant_linear(x, unbound), torch_quant_linear(x, w))


def test_an_lm_head_takes_the_exact_path_for_more_rows(isa, monkeypatch):
    """Past STRIP_EXACT_ROWS a decoder layer's weight is dequantized for torch's matmul, an
    LM head's (more than HEAD_ROWS rows) only past STRIP_EXACT_ROWS_HEAD."""
    import models.quantization.cpu_quant_linear as mod

    monkeypatch.setattr(mod, "HEAD_ROWS", 64)
    w = make_weight(72, 64, 8, 32, False, torch.float32)
    prepared = prepare_quant_weight(w, KernelSet(cpu=True, isa=isa, int8_activations=False))
    if not prepared.kernel.strip_width():
        return
    s = prepared.weight
    for m, exact in ((mod.STRIP_EXACT_ROWS + 1, True), (mod.STRIP_EXACT_ROWS_HEAD + 1, False)):
        x = torch.randn(m, 64)
        out = quant_linear(x, prepared)
        expected = kernel_out = prepared.kernel.strip_linear_f32(x, *strip_args(s))
        if not exact:
            expected = torch_quant_linear(x, w)
            assert not torch.equal(out, kernel_out)
        assert torch.equal(out, expected), m


def test_the_strip_kernels_decline_what_they_do_not_take(kernel):
    s = to_strips(make_weight(16, 64, 4, 32, True, torch.float32))
    q, scales, mins, bits, block_size = strip_args(s)
    x = torch.randn(2, 64)
    assert kernel.strip_linear_f32(x.bfloat16(), *strip_args(s)) is None
    assert kernel.strip_linear_f32(torch.randn(2, 96), *strip_args(s)) is None
    assert kernel.strip_linear_f32(x, *strip_args(s), torch.randn(15)) is None
    assert kernel.strip_linear_f32(x, q[:, :-4], scales, mins, bits, block_size) is None
    assert kernel.strip_linear_int8(x.bfloat16(), q, scales, mins.half(), bits, block_size) is None
    assert kernel.strip_linear_int8(x.bfloat16(), q, scales.flatten(1), mins, bits, 32) is None
    assert kernel.strip_linear_int8(x.double(), *strip_args(s)) is None
    assert not kernel.strip_dequantize_into(
        torch.empty(16, 64, dtype=torch.float64), *strip_args(s)
    )
