"""The fused Triton kernels (models/layers/triton_ops.py; on the GPU, or under
TRITON_INTERPRET=1 without one) against the layers' torch code, and the layers' kernels as
the kernel set of their device has them: Triton on CUDA, C++ or torch on the CPU.

Tolerances are a few units of the dtype's rounding: the kernels sum in another order, and
the interpreter rounds float32 to bfloat16 by truncation where the GPU rounds to nearest.
In float16, which both round to nearest, almost every element must agree exactly: that pins
down where the kernels round (a rounding left out changes about a fifth of them).
"""

from __future__ import annotations

import pytest
import torch

from kernels import KernelSet
from models.layers import triton_ops
from models.layers.activation import SiluAndMul
from models.layers.fused_ops import fused_ops
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAS_CUDA = torch.cuda.is_available()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
    """Equal within 4 units of rounding of expected's dtype, relative and at `scale`."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual, expected, rtol=4 * eps, atol=4 * eps * scale)
    if expected.dtype == torch.float16:
        differ = (actual != expected).float().mean().item()
        assert differ < 0.02, f"{differ:.1%} of the elements differ"


def make_norm(hidden: int, dtype: torch.dtype, device: str) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden).to(dtype)
    return norm.to(device)


def rows(shape: tuple[int, ...], dtype: torch.dtype, device: str, strided: bool) -> torch.Tensor:
    """randn rows of `shape`; with `strided`, a view whose rows are strided (the last
    dimension padded, as q inside the fused qkv rows)."""
    if not strided:
        return torch.randn(shape, dtype=dtype, device=device) * 3
    padded = torch.randn((*shape[:-1], shape[-1] + 16), dtype=dtype, device=device) * 3
    return padded[..., : shape[-1]]


NORM_SHAPES = [(1, 576), (7, 1000), (33, 64), (5,), (3, 9, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_rms_norm(kernel_device, dtype, shape, strided):
    torch.manual_seed(sum(shape))
    norm = make_norm(shape[-1], dtype, kernel_device)
    x = rows(shape, dtype, kernel_device, strided)
    out = triton_ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert out.is_contiguous()
    assert_close(out, norm.forward_torch(x), scale=10.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_add_rms_norm_into_new_tensors_and_in_place(kernel_device, dtype, shape):
    torch.manual_seed(sum(shape) + 1)
    norm = make_norm(shape[-1], dtype, kernel_device)
    x = rows(shape, dtype, kernel_device, strided=len(shape) == 3)
    residual = rows(shape, dtype, kernel_device, strided=False)
    expected_out, expected_sum = norm.forward_torch(x, residual)
    out, total = torch.empty_like(residual), torch.empty_like(residual)
    triton_ops.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon, out, total)
    assert_close(total, expected_sum, scale=10.0)
    assert_close(out, expected_out, scale=10.0)
    triton_ops.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon, x, residual)
    assert_close(residual, expected_sum, scale=10.0)
    assert_close(x, expected_out, scale=10.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True], ids=["new", "in-place"])
def test_rms_norm_layer_semantics(kernel_device, dtype, in_place):
    """RMSNorm.forward on the kernel device: (norm(x + residual), x + residual), written
    into x and residual when in place and into new tensors otherwise."""
    torch.manual_seed(3)
    norm = make_norm(1000, dtype, kernel_device)
    norm.bind_kernels(KernelSet(triton=True))
    assert norm.ops is triton_ops
    x = rows((4, 1000), dtype, kernel_device, strided=False)
    residual = rows((4, 1000), dtype, kernel_device, strided=False)
    x_before, residual_before = x.clone(), residual.clone()
    expected_out, expected_sum = norm.forward_torch(x, residual)
    out, total = norm(x, residual, in_place=in_place)
    assert_close(out, expected_out, scale=10.0)
    assert_close(total, expected_sum, scale=10.0)
    if in_place:
        assert out.data_ptr() == x.data_ptr() and total.data_ptr() == residual.data_ptr()
    else:
        assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1152), (7, 2000), (3, 2, 128), (2, 3000), (4,)], ids=str)
def test_silu_and_mul(kernel_device, dtype, shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape, dtype=dtype, device=kernel_device) * 3
    out = triton_ops.silu_and_mul(x)
    assert out.is_contiguous()
    assert_close(out, SiluAndMul.forward_torch(x), scale=10.0)


def make_rope(head_dim: int, max_position: int, device: str) -> RotaryEmbedding:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return RotaryEmbedding(head_dim, max_position, inv_freq).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rotary_rotates_q_and_k_of_fused_qkv_rows_in_place(
    kernel_device, dtype, head_dim, num_tokens
):
    """q (9 heads) and k (3 heads) are views into qkv rows; v is left alone."""
    torch.manual_seed(head_dim + num_tokens)
    q_heads, kv_heads = 9, 3
    rope = make_rope(head_dim, 100, kernel_device)
    positions = torch.tensor([97, 3, 50, 0, 3, 99, 12][:num_tokens], device=kernel_device)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=kernel_device)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    v_before = v.clone()
    cos, sin = rope.get_cos_sin(positions, dtype)
    expected_q, expected_k = (
        apply_rotary(q, cos, sin, head_dim),
        apply_rotary(k, cos, sin, head_dim),
    )
    assert triton_ops.rotary_fits(q, k, head_dim)
    assert triton_ops.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim)
    assert_close(q, expected_q, scale=4.0)
    assert_close(k, expected_k, scale=4.0)
    assert torch.equal(v, v_before)


def test_empty_batches(kernel_device):
    norm = make_norm(64, torch.float32, kernel_device)
    x = torch.empty(0, 64, device=kernel_device)
    assert triton_ops.rms_norm(x, norm.weight, 1e-5).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, device=kernel_device)).shape == (0, 64)
    rope = make_rope(64, 8, kernel_device)
    positions = torch.empty(0, dtype=torch.int64, device=kernel_device)
    triton_ops.rotary_embedding(positions, x, x, rope.cos_cache, rope.sin_cache, 64)


def test_the_kernel_set_of_a_cuda_model_has_them():
    assert fused_ops(KernelSet.for_device("cuda", environ={})) is triton_ops
    assert fused_ops(KernelSet()) is None
    assert fused_ops(KernelSet(cpu=True)) is not triton_ops


def test_the_kernels_decline_what_they_do_not_take():
    x = torch.randn(3, 8, dtype=torch.float64)
    out, total = torch.zeros_like(x), torch.zeros_like(x)
    assert triton_ops.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-5) is None
    assert not triton_ops.add_rms_norm(x, x, torch.ones(8, dtype=torch.float64), 1e-5, out, total)
    assert triton_ops.silu_and_mul(x) is None
    assert triton_ops.silu_and_mul(torch.randn(3, 7)) is None
    cache = torch.zeros(4, 4)
    assert not triton_ops.rotary_embedding(torch.arange(3), x, x, cache, cache, 8)
    assert not out.any() and not total.any()


def test_shapes_the_kernels_do_not_take():
    weight = torch.ones(64, dtype=torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert triton_ops.norm_fits(x, weight, x)
    assert not triton_ops.norm_fits(x, weight.float())  # the torch code promotes
    assert not triton_ops.norm_fits(x.t().contiguous().t(), weight)  # last dim strided
    assert not triton_ops.norm_fits(x.reshape(1, 2, 2, 64), weight)
    assert not triton_ops.norm_fits(x, weight, torch.randn(4, 64))
    wide = triton_ops.MAX_NORM_BLOCK + 1
    assert not triton_ops.norm_fits(torch.empty(1, wide), torch.empty(wide))
    q, k = torch.randn(3, 9 * 64), torch.randn(3, 3 * 64)
    assert triton_ops.rotary_fits(q, k, 64)
    assert not triton_ops.rotary_fits(q, k.bfloat16(), 64)
    assert not triton_ops.rotary_fits(q.double(), k.double(), 64)
    assert not triton_ops.rotary_fits(q.reshape(3, 9, 64), k, 64)
    assert not triton_ops.rotary_fits(q, k[:2], 64)
    assert not triton_ops.rotary_fits(q, k, 128)  # 3 * 64 is no whole head


@pytest.fixture
def triton_calls(monkeypatch) -> list[str]:
    """The names of the Triton kernels the layers call (each still runs)."""
    calls: list[str] = []

    def spy(name: str):
        kernel = getattr(triton_ops, name)

        def call(*args):
            calls.append(name)
            return kernel(*args)

        return call

    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding"):
        monkeypatch.setattr(triton_ops, name, spy(name))
    return calls


def run_layers(device: str, dtype: torch.dtype) -> None:
    """Every fused layer, with the kernel set of a model on `device`, once, checked against
    its torch code."""
    kernels = KernelSet.for_device(device, environ={})
    norm = make_norm(576, dtype, device)
    norm.bind_kernels(kernels)
    x = torch.randn(5, 576, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    assert_close(norm(x), norm.forward_torch(x), scale=10.0)
    out, total = norm(x, residual)
    assert_close(out, norm.forward_torch(x, residual)[0], scale=10.0)
    gate_up = torch.randn(5, 256, dtype=dtype, device=device)
    act = SiluAndMul()
    act.bind_kernels(kernels)
    assert_close(act(gate_up), SiluAndMul.forward_torch(gate_up), scale=10.0)
    rope = make_rope(64, 32, device)
    rope.bind_kernels(kernels)
    positions = torch.tensor([4, 0, 31, 4, 9], device=device)
    q, k = (
        torch.randn(5, 9 * 64, dtype=dtype, device=device),
        torch.randn(5, 3 * 64, dtype=dtype, device=device),
    )
    cos, sin = rope.get_cos_sin(positions, dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin, 64), apply_rotary(k, cos, sin, 64)
    q, k = rope.rotator(positions, dtype)(q, k)
    assert_close(q, expected_q, scale=4.0)
    assert_close(k, expected_k, scale=4.0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_run_triton_kernels_on_cuda_tensors(triton_calls, dtype):
    run_layers("cuda", dtype)
    assert triton_calls == ["rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_never_run_triton_kernels_on_cpu_tensors(triton_calls, dtype):
    run_layers("cpu", dtype)
    assert triton_calls == []


def test_the_switch_sends_cuda_tensors_to_the_torch_code():
    """SPLITSERVE_TRITON_KERNELS=0: no Triton for the layers nor the sampler (read once,
    into the kernel set)."""
    from worker.sampler import Sampler

    on = KernelSet.for_device("cuda", environ={})
    off = KernelSet.for_device("cuda", environ={"SPLITSERVE_TRITON_KERNELS": "0"})
    assert on.triton and not off.triton and not on.cpu
    assert fused_ops(off) is None
    layers = (make_norm(64, torch.float32, "cpu"), SiluAndMul(), make_rope(64, 32, "cpu"))
    for layer in layers:
        layer.bind_kernels(off)
        assert layer.ops is None
    assert Sampler(kernels=on).triton and not Sampler(kernels=off).triton
