"""The dense float32-math kernel's register tiles (models/layers/cpu_dense_tiles.h: the GEMM
tile on a panel, the dot-product tile of few rows) built for Arm and run in an emulator
(tests/kernels/aarch64_emulator.py): bitwise the AVX2 build's dense_linear on the same
weight and rows, and within float32 rounding of float64, for float32 and bf16 weights,
every tile height, with and without a bias."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from models.layers.cpu_linear import dense_linear_kernel
from tests.kernels.aarch64_emulator import Aarch64Program, avx2_build, program_of

PANEL = 16  # features of a panel (2 vectors of 8)


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Aarch64Program:
    return program_of("neon_dense_harness.cpp", ["models/layers"], tmp_path_factory.mktemp("neon"))


@pytest.fixture(scope="module")
def x86_dense():
    return avx2_build(dense_linear_kernel)


def bits(w: torch.Tensor) -> np.ndarray:
    return (w.view(torch.int16) if w.dtype == torch.bfloat16 else w).numpy()


def call(program, op, w, rows, k, w_at, w_stride, x, bias, out_floats, cols=0) -> np.ndarray:
    program_x = program.put(x.numpy())
    bias_at = 0 if bias is None else program.put(bias.numpy())
    out = program.put(np.zeros(out_floats, np.float32))
    packed = program.put(np.zeros(x.numel(), np.float32))
    fields = (op, int(w.dtype == torch.bfloat16), rows, k, w_at, w_stride, program_x, bias_at,
              out, cols, packed)  # fmt: skip
    program.call(program.put(np.frombuffer(struct.pack(f"<{len(fields)}q", *fields), np.uint8)))
    return program.get(out, np.float32, out_floats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_neon_gemm_tile_matches_the_avx2_build(program, x86_dense, dtype, with_bias):
    gen = torch.Generator().manual_seed(1)
    k = 72
    w = torch.randn(PANEL, k, generator=gen).to(dtype)
    bias = torch.randn(PANEL, generator=gen) if with_bias else None
    program.clear()
    panel_at = program.put(bits(w.T.contiguous()))  # [K][16], features in order on Arm
    for rows in range(1, 7):
        x = torch.randn(rows, k, generator=gen)
        out = call(program, 1, w, rows, k, panel_at, 0, x, bias, rows * PANEL)
        out = torch.from_numpy(out).view(rows, PANEL)
        expected = x.double() @ w.double().T + (0 if bias is None else bias.double())
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        if x86_dense is not None:
            panels = x86_dense.pack_weight_panels(w)
            assert torch.equal(x86_dense.dense_linear(x, panels, bias), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neon_dot_tile_matches_the_avx2_build(program, x86_dense, dtype):
    gen = torch.Generator().manual_seed(2)
    k, features = 136, 3  # a multiple of 8: no scalar tail
    w = torch.randn(features, k, generator=gen).to(dtype)
    program.clear()
    w_at = program.put(bits(w))
    for rows in range(1, 5):
        x = torch.randn(rows, k, generator=gen)
        sums = call(program, 0, w, rows, k, w_at, k, x, None, rows * features)
        out = torch.from_numpy(sums).view(rows, features)
        expected = x.double() @ w.double().T
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        if x86_dense is not None:
            assert torch.equal(x86_dense.dense_linear(x, w, None), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neon_moe_dot_blocks_match_float64(program, dtype):
    """The MoE kernel's tiles (models/layers/dot_tiles.h) on Arm: x's rows packed, every
    tile shape (1 to 4 rows by 1 to 4 weight rows), a k past the last whole step."""
    gen = torch.Generator().manual_seed(3)
    k, cols = 83, 7
    w = torch.randn(cols, k, generator=gen).to(dtype)
    program.clear()
    w_at = program.put(bits(w))
    for rows in (1, 2, 3, 4, 6, 9):
        x = torch.randn(rows, k, generator=gen)
        out = call(program, 2, w, rows, k, w_at, k, x, None, rows * cols, cols)
        expected = x.double() @ w.double().T
        out = torch.from_numpy(out).view(rows, cols).double()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
