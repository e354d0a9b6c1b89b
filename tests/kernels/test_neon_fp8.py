"""The fp8 linear kernel's dot products (models/quantization/cpu_fp8_tiles.h) built for Arm
and run in an emulator (tests/kernels/aarch64_emulator.py): bitwise the AVX2 build's
fp8 linear on the same weight and rows (the bias left out: the sums times the scale),
and within float32 rounding of float64, for every row group (1 to 9 rows), an odd weight
row, a K with a scalar tail, and every e4m3 byte (subnormals, the NaN byte as 480)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.quantization.cpu_fp8_linear import FP8_DTYPE, fp8_kernel
from tests.kernels.aarch64_emulator import Aarch64Program, avx2_build, program_of


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Aarch64Program:
    folder = tmp_path_factory.mktemp("neon")
    return program_of("neon_fp8_harness.cpp", ["models/quantization"], folder, "neon")


@pytest.fixture(scope="module")
def x86_fp8():
    return avx2_build(fp8_kernel)


def byte_values(w: np.ndarray) -> np.ndarray:
    """Each e4m3 byte's value, the NaN bytes as the kernels read them (+-480)."""
    raw = torch.from_numpy(w)
    values = raw.view(FP8_DTYPE).double()
    return torch.where(values.isnan(), torch.where(raw < 128, 480.0, -480.0).double(), values)


@pytest.mark.parametrize("k", [256, 48, 40], ids=lambda k: f"k{k}")
def test_neon_fp8_dots_match_the_avx2_build(program, x86_fp8, k):
    gen = torch.Generator().manual_seed(k)
    n = 7  # three pairs of weight rows and one alone
    w = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8).numpy()
    w[0, :] = np.arange(k) % 256  # every byte, where k reaches
    w[1] = np.arange(k)[::-1]
    scale = torch.rand(n, generator=gen) + 0.5
    program.clear()
    w_at = program.put(w)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        x = torch.randn(rows, k, generator=gen)
        dots_at = program.put(np.zeros(n * rows, np.float32))
        call = np.array([rows, n, k, w_at, program.put(x.numpy()), dots_at], np.int64)
        program.call(program.put(call))
        dots = torch.from_numpy(program.get(dots_at, np.float32, n * rows)).view(n, rows).T
        values = byte_values(w)
        expected = x.double() @ values.T / 256.0
        magnitude = x.double().abs() @ values.abs().T / 256.0
        assert ((dots.double() - expected).abs() <= 1e-6 * magnitude + 1e-9).all()
        if x86_fp8 is not None:
            out = x86_fp8.linear(x, torch.from_numpy(w), scale, None)
            assert torch.equal(out, dots * (scale * 256.0))
