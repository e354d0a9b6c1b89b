"""The AMX small-batch linear kernel (models/layers/cpu_linear.cpp) against a float32
reference: within one bf16 rounding of it, as F.linear is; and the layers' use of it
(packed at load for bf16 on the CPU, small batches only). Skipped where the CPU or the
process has no AMX tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention import set_forward_context
from kernels import KernelSet
from models import load_model
from models.layers import cpu_linear
from models.layers.cpu_linear import PackedWeight, linear, linear_kernel, pack_weight
from models.layers.embedding import ParallelLMHead
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from tests.models.tiny import make_tiny_checkpoint

KERNELS = KernelSet(cpu=True)
pytestmark = pytest.mark.skipif(
    linear_kernel(KERNELS) is None, reason="no AMX tiles on this CPU (or no compiler)"
)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out if bias is None else out + bias.double()


def assert_one_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 keeps 8 significant bits: a float32 sum rounded once lands within one unit of
    the last place of the exact value, i.e. 2^-7 of it (plus the sum's own error)."""
    assert actual.dtype == torch.bfloat16
    error = (actual.double() - expected).abs()
    assert (error <= expected.abs() * 2**-7 + 1e-4).all(), error.max()


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 100, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 64), (960, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_is_one_rounding_from_the_exact_product(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    ops = linear_kernel(KERNELS)
    out = ops.linear(x, ops.pack_weight(w), bias)
    assert out.shape == (rows, out_features)
    assert_one_rounding(out, reference(x, w, bias))
    assert_one_rounding(F.linear(x, w, bias), reference(x, w, bias))  # the same bar


def test_kernel_reads_strided_rows_and_threads_agree():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    rows = torch.randn(40, 160, generator=gen).bfloat16()[:, 32:128]  # row stride 160
    ops = linear_kernel(KERNELS)
    packed = ops.pack_weight(w)
    torch.set_num_threads(1)  # the conftest fixture restores the thread count
    one_thread = ops.linear(rows, packed)
    torch.set_num_threads(2)
    assert torch.equal(ops.linear(rows, packed), one_thread)
    assert torch.equal(one_thread, ops.linear(rows.contiguous(), packed))
    assert_one_rounding(one_thread, reference(rows, w, None))


def test_kernel_refuses_what_it_cannot_take():
    """Weights and inputs it does not take it declines (None); an input that does not fit
    its packed weight raises."""
    ops = linear_kernel(KERNELS)
    assert ops.pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16)) is None  # 48 % 32
    assert ops.pack_weight(torch.zeros(32, 64)) is None  # float32
    assert ops.pack_weight(torch.zeros(2, 32, 64, dtype=torch.bfloat16)) is None
    packed = ops.pack_weight(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert ops.linear(torch.zeros(2, 64), packed) is None  # float32
    assert ops.linear(torch.zeros(64, 2, dtype=torch.bfloat16).t(), packed) is None  # strided
    assert ops.linear(torch.zeros(1, 2, 64, dtype=torch.bfloat16), packed) is None
    with pytest.raises(RuntimeError, match="features"):
        ops.linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed)
    assert ops.linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)


def test_linear_takes_the_kernel_for_small_batches_only():
    calls = []
    ops = linear_kernel(KERNELS)

    class Spy:
        def linear(self, *args):
            out = ops.linear(*args)
            calls.append(args[0].shape[0] if out is not None else "declined")
            return out

    w = torch.randn(64, 64).bfloat16()
    packed = PackedWeight(Spy(), ops.pack_weight(w))
    limit = cpu_linear.SMALL_BATCH_ROWS
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64).bfloat16()
        assert_one_rounding(linear(x, w, None, packed), reference(x, w, None))
    linear(torch.randn(3, 64).bfloat16(), w)  # nothing packed
    x3 = torch.randn(2, 3, 64).bfloat16()  # not rows
    assert torch.equal(linear(x3, w, None, packed), F.linear(x3, w))
    assert calls == [1, limit, "declined"]


def test_layers_pack_only_with_a_kernel_set_that_has_the_kernel():
    w = torch.randn(64, 64).bfloat16()
    assert isinstance(pack_weight(w, KERNELS), PackedWeight)
    assert not pack_weight(w.float(), KERNELS).amx  # float32: the dense kernel
    assert pack_weight(w, KernelSet()) is None  # SPLITSERVE_CPU_KERNELS=0
    below_amx = pack_weight(w, KernelSet(cpu=True, isa="avx512_bf16"))
    assert below_amx is not None and not below_amx.amx  # the bf16 kernel of that rung
    layer = ColumnParallelLinear(64, 64, bias=False)
    layer.weight.data = w
    layer.bind_kernels(KERNELS)
    x = torch.randn(3, 64).bfloat16()
    packed_out = layer(x)
    layer.bind_kernels(KernelSet())
    assert layer.packed_weight is None
    assert torch.equal(layer(x), F.linear(x, w))
    assert_one_rounding(packed_out, reference(x, w, None))


def test_load_model_packs_bf16_cpu_layers_and_keeps_the_logits(tmp_path):
    """bf16 on the CPU: every linear layer and the LM head gets a packed weight, and a
    small batch's logits are those of the same model without them, up to roundings."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    model = load_model(path, torch.bfloat16, kernels=KERNELS)
    layers = [
        m
        for m in model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
    ]
    assert layers and all(m.packed_weight is not None for m in layers)
    ids = torch.tensor([3, 17, 42, 7, 99])
    positions = torch.arange(5)
    with torch.inference_mode(), set_forward_context(None):
        packed = model.compute_logits(model(ids, positions))
        for m in layers:
            m.packed_weight = None
        plain = model.compute_logits(model(ids, positions))
    torch.testing.assert_close(packed.float(), plain.float(), rtol=0.05, atol=0.05)
    fp32 = load_model(path, torch.float32, kernels=KERNELS)
    fp32_packed = [m.packed_weight for m in fp32.modules() if hasattr(m, "packed_weight")]
    assert fp32_packed and not any(p.amx for p in fp32_packed)  # the dense kernel's
