"""The Arm strip passes (models/quantization/cpu_quant_strips_neon.h) built for aarch64,
with the dot-product extension (`sdot`) and without (Armv8.0), and run in an emulator
(tests/kernels/aarch64_emulator.py): against the x86 strip kernel on the same weight and
activations, bitwise (the same float operations in the same order), and against float64
references, for every weight layout, 1 to 4 rows a pass."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.quantization.cpu_quant_linear import quant_kernel
from models.quantization.strips import to_strips
from tests.kernels.aarch64_emulator import Aarch64Program, avx2_build, program_of
from tests.quantization.kernel_cases import LAYOUTS, int8_reference, magnitude, make_weight

N, ROWS = 16, 4  # two strips; passes of 1 to 4 rows (the Arm build's most)


@pytest.fixture(scope="module", params=["neon", "neon_dotprod"])
def program(request, tmp_path_factory) -> Aarch64Program:
    folder = tmp_path_factory.mktemp("neon")
    return program_of("neon_strips_harness.cpp", ["models/quantization"], folder, request.param)


@pytest.fixture(scope="module")
def x86_strips():
    return avx2_build(quant_kernel)


def quantized_acts(x: torch.Tensor, block_size: int) -> dict[str, np.ndarray]:
    """x quantized per 32-run as quantize_acts does (float32 operations in its order)."""
    m, k = x.shape
    runs = x.reshape(m, k // 32, 32)
    d = runs.abs().amax(dim=2) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(runs * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(m, k)
    halves = q.reshape(m, k // 16, 16).to(torch.int32).sum(dim=2).float()  # exact
    terms = (d.repeat_interleave(2, dim=1) * halves).numpy()
    per_block = block_size // 16
    sums = np.zeros((m, k // block_size), np.float32)
    for h in range(per_block):  # float32 sums in the kernel's order
        sums = sums + terms[:, h::per_block]
    half_block = (np.arange(0, k, 16) // block_size).astype(np.int32)
    return {"q": q.numpy(), "d": d.numpy(), "sums": sums, "half_block": half_block}


def half_sums(x: torch.Tensor) -> np.ndarray:
    """x's sums over each 16 features, in order, as strip_linear_f32 adds them."""
    h = x.numpy().reshape(x.shape[0], -1, 16)
    total = np.zeros(h.shape[:2], np.float32)
    for e in range(16):
        total = total + h[:, :, e]
    return total


def run_pass(program, s, int8: bool, rows: int, row0: int, acts, x, xsums) -> torch.Tensor:
    """Rows row0 .. row0 + rows - 1 of x through every strip's pass: [rows, N]."""
    program.clear()
    at = {name: program.put(a) for name, a in acts.items()}
    q, scales = program.put(s.q.numpy()), program.put(s.scales.numpy())
    mins = 0 if s.mins is None else program.put(s.mins.numpy())
    xp, xs = program.put(x.numpy()), program.put(xsums)
    k = x.shape[1]
    res = program.put(np.zeros((rows, 8), np.float32))
    out = torch.empty(rows, N)
    for strip in range(N // 8):
        fields = (
            int(int8), s.bits, int(s.block_size % 32 == 0), rows, strip, row0,
            q, scales, mins, int(s.scales.dtype == torch.float16), N, k, s.block_size,
            at["q"], at["d"], at["sums"], at["half_block"], k // 32,
            xp + 4 * row0 * k, k, xs + 4 * row0 * (k // 16), res,
        )  # fmt: skip
        call = program.put(np.frombuffer(struct.pack(f"<{len(fields)}q", *fields), np.uint8))
        program.call(call)
        values = program.get(res, np.float32, rows * 8).reshape(rows, 8)
        out[:, 8 * strip : 8 * strip + 8] = torch.from_numpy(values)
    return out


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mins", [False, True], ids=["no-mins", "mins"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "block_size"), LAYOUTS, ids=str)
def test_neon_strip_passes_match_the_x86_kernel_and_the_references(
    program, x86_strips, bits, mins, scale_dtype, k, block_size
):
    w = make_weight(N, k, bits, block_size, mins, scale_dtype)
    s = to_strips(w)
    x = torch.randn(ROWS, k)
    acts, xsums = quantized_acts(x, block_size), half_sums(x)
    args = (s.q, s.scales, s.mins, s.bits, s.block_size)
    for rows in range(1, ROWS + 1):
        row0 = ROWS - rows
        xr = x[row0:]
        int8 = run_pass(program, s, True, rows, row0, acts, x, xsums)
        exact = run_pass(program, s, False, rows, row0, acts, x, xsums)
        ref, xq = int8_reference(xr, w)
        assert ((int8.double() - ref).abs() <= 1e-5 * magnitude(xq, w) + 1e-6).all()
        ref = F.linear(xr.double(), w.dequantize(torch.float64))
        assert ((exact.double() - ref).abs() <= 1e-5 * magnitude(xr, w) + 1e-6).all()
        if x86_strips is not None:
            assert torch.equal(int8, x86_strips.strip_linear_int8(xr, *args))
            assert torch.equal(exact, x86_strips.strip_linear_f32(xr, *args))


@pytest.fixture(scope="module")
def quantize_program(tmp_path_factory) -> Aarch64Program:
    folder = tmp_path_factory.mktemp("neon")
    return program_of("neon_quantize_harness.cpp", ["models/quantization"], folder, "neon")


def quantize_in_emulator(program: Aarch64Program, x: torch.Tensor) -> tuple[np.ndarray, ...]:
    program.clear()
    runs = x.numel() // 32
    raw = x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32).numpy()
    q, d = program.put(np.zeros(runs * 32, np.int8)), program.put(np.zeros(runs, np.float32))
    dtype = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[x.dtype]
    call = program.put(np.array([dtype, runs, program.put(raw), q, d], np.int64))
    program.call(call)
    return program.get(q, np.int8, runs * 32).reshape(x.shape), program.get(d, np.float32, runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_neon_quantize_run_matches_torch(quantize_program, dtype):
    """quantize_run's NEON path: the bytes and scales of torch's float32 operations (round
    half to even), for random runs, a run of zeros and one of exact ties."""
    x = torch.randn(4, 256) * torch.logspace(-3, 3, 4)[:, None]
    x[1, :32] = 0.0
    x[2, :32] = torch.tensor([127.0, -127.0] + [k + 0.5 for k in range(-15, 15)])
    x = x.to(dtype)
    q, d = quantize_in_emulator(quantize_program, x)
    ref = quantized_acts(x.float(), 32)
    assert np.array_equal(q, ref["q"]) and np.array_equal(d, ref["d"].reshape(-1))
    assert (q[1, :32] == 0).all() and d[8] == 0.0
    assert q[2, 2:32].tolist() == [round(k + 0.5) for k in range(-15, 15)]  # to even


def test_neon_quantize_run_ignores_nan_in_the_scale(quantize_program):
    """A NaN counts 0 in the run's max and becomes -127, as on AVX2 (max/min with the NaN
    first give the other operand)."""
    x = torch.randn(1, 32)
    x[0, 5] = float("nan")
    q, d = quantize_in_emulator(quantize_program, x)
    ref = quantized_acts(torch.where(x.isnan(), 0.0, x), 32)
    assert d[0] == ref["d"][0, 0] and q[0, 5] == -127
    assert np.array_equal(np.delete(q[0], 5), np.delete(ref["q"][0], 5))
