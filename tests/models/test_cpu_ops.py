"""The fused C++ CPU kernels (models/layers/cpu_ops.cpp) against the layers' torch code:
bitwise equal, in bf16, fp16 and fp32. The kernels are always built here (a compiler is
required), whatever SPLITSERVE_CPU_KERNELS says outside."""

from __future__ import annotations

import pytest
import torch

import kernels.kernel_set
from kernels import KernelSet
from models import load_model
from models.layers.activation import SiluAndMul
from models.layers.fused_ops import fused_ops
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, apply_rotary
from models.loader import bind_kernels

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def ops():
    module = fused_ops(KernelSet(cpu=True))
    assert module is not None, "the C++ kernels failed to build"
    return module


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    torch.set_num_threads(request.param)  # the conftest fixture restores it


def make_norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden).to(dtype)
    return norm


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected), f"{(actual != expected).sum()} elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 576), (333, 576), (7, 17), (5, 8), (3, 4096), (576,)], ids=str
)
def test_rms_norm(ops, threads, dtype, shape):
    norm = make_norm(shape[-1], dtype)
    x = torch.randn(shape, dtype=dtype) * 3
    assert_same(ops.rms_norm(x, norm.weight, 1e-5), norm.forward_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 9, 64), (333, 4, 128)])
def test_rms_norm_per_head_of_a_strided_view(ops, dtype, tokens, heads, head_dim):
    """Qwen3's q/k norm: [T, heads, head_dim] views of q inside the fused qkv rows."""
    norm = make_norm(head_dim, dtype)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    assert tokens == 1 or not q.is_contiguous()
    out = ops.rms_norm(q, norm.weight, 1e-5)
    assert out.is_contiguous()
    assert_same(out, norm.forward_torch(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (333, 576), (9, 3, 64)], ids=str)
def test_add_rms_norm_into_new_tensors_and_in_place(ops, threads, dtype, shape):
    norm = make_norm(shape[-1], dtype)
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    expected_out, expected_sum = norm.forward_torch(x, residual)
    out, total = torch.empty_like(x), torch.empty_like(x)
    assert ops.add_rms_norm(x, residual, norm.weight, 1e-5, out, total)
    assert_same(out, expected_out)
    assert_same(total, expected_sum)
    assert ops.add_rms_norm(x, residual, norm.weight, 1e-5, x, residual)  # in place, as vLLM
    assert_same(x, expected_out)
    assert_same(residual, expected_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 9, 3, 64), (333, 9, 3, 64), (17, 4, 1, 128), (5, 2, 2, 40), (3, 4, 2, 8)],
)
def test_rotary_in_place_on_views_of_qkv(ops, threads, dtype, tokens, heads, kv_heads, head_dim):
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rope = RotaryEmbedding(head_dim, 4096, inv_freq, attention_scaling=1.1)
    positions = torch.randint(0, 4096, (tokens,))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=dtype) * 2
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = rope.get_cos_sin(positions, dtype)
    expected_q, expected_k = (
        apply_rotary(q, cos, sin, head_dim),
        apply_rotary(k, cos, sin, head_dim),
    )
    v_before = v.clone()
    assert ops.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim)
    assert_same(q, expected_q)
    assert_same(k, expected_k)
    assert_same(v, v_before)


def test_rotary_refuses_what_it_cannot_take(ops):
    """A position out of range or int32 positions raise, before any row is written; q or k
    it does not take (strided last dimension, another dtype, no whole heads) it declines."""
    rope = RotaryEmbedding(8, 16, torch.ones(4))
    q, k = torch.randn(2, 16), torch.randn(2, 8)
    q_before, k_before = q.clone(), k.clone()
    args = (rope.cos_cache, rope.sin_cache, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rotary_embedding(torch.tensor([0, 16]), q, k, *args)
    with pytest.raises(RuntimeError, match="int64"):
        ops.rotary_embedding(torch.tensor([0, 1], dtype=torch.int32), q, k, *args)
    positions = torch.tensor([0, 1])
    strided = torch.randn(16, 2).t()
    assert not ops.rotary_embedding(positions, strided, k, *args)
    assert not ops.rotary_embedding(positions, q, k.double(), *args)
    assert not ops.rotary_embedding(positions, q, torch.randn(2, 12), *args)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_kernels_decline_tensors_they_do_not_take(ops):
    weight = torch.ones(8)
    x = torch.randn(8, 6).t()  # last dimension strided
    declined = [
        ops.rms_norm(x, weight, 1e-5),
        ops.rms_norm(torch.randn(2, 3, 4, 8), weight, 1e-5),  # four dimensions
        ops.rms_norm(torch.randn(3, 8, dtype=torch.float64), weight.double(), 1e-5),
        ops.rms_norm(torch.randn(3, 8), weight.bfloat16(), 1e-5),  # the torch code promotes
        ops.silu_and_mul(torch.randn(3, 7)),  # odd
        ops.silu_and_mul(torch.randn(3, 8, dtype=torch.float64)),
    ]
    assert declined == [None] * len(declined)
    y, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, total = torch.zeros(3, 8), torch.zeros(3, 8)
    assert not ops.add_rms_norm(y, residual.double(), weight, 1e-5, out, total)
    assert not ops.add_rms_norm(y, residual, weight, 1e-5, out, torch.zeros(3, 16)[:, ::2])
    assert not out.any() and not total.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (333, 3072), (7, 74), (5, 200), (2, 3, 128)], ids=str)
def test_silu_and_mul(ops, threads, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 4
    assert_same(ops.silu_and_mul(x), SiluAndMul.forward_torch(x))


def test_silu_and_mul_of_strided_rows(ops):
    wide = torch.randn(9, 300, dtype=torch.bfloat16)
    x = wide[:, :256]
    assert_same(ops.silu_and_mul(x), SiluAndMul.forward_torch(x))


# --- the layers: the kernel set's kernel where it takes the tensors, torch code otherwise ----


class Spy:
    """The kernels, recording the names of those called and whether each took its tensors."""

    def __init__(self, ops) -> None:
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        def call(*args):
            result = getattr(self.ops, name)(*args)
            self.calls.append(name if result is not None and result is not False else "declined")
            return result

        return call


def bind(layers, ops) -> None:
    for layer in layers:
        layer.ops = ops


@pytest.mark.parametrize("disable", ["kernel set", "no-compiler"])
def test_layers_use_the_kernels_and_fall_back(ops, monkeypatch, disable):
    dtype = torch.bfloat16
    norm, act = make_norm(64, dtype), SiluAndMul()
    rope = RotaryEmbedding(16, 64, torch.rand(8))
    spy = Spy(ops)
    bind((norm, act, rope), spy)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    positions = torch.arange(5)

    def run():
        q, k = torch.randn(5, 64, dtype=dtype), torch.randn(5, 32, dtype=dtype)
        return (norm(x), *norm(x, residual), act(x), *rope.rotator(positions, dtype)(q, k))

    torch.manual_seed(0)
    with_kernels = run()
    assert spy.calls == ["rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding"]
    assert_same(x, x_before)  # forward(x, residual) leaves its inputs alone
    assert_same(residual, residual_before)
    kernel_set = KernelSet(cpu=True)
    if disable == "kernel set":  # SPLITSERVE_CPU_KERNELS=0
        kernel_set = KernelSet()
    else:
        monkeypatch.setattr(kernels.kernel_set, "load_cpp_extension", lambda *a: None)
    for layer in (norm, act, rope):
        layer.bind_kernels(kernel_set)
    assert norm.ops is act.ops is rope.ops is None
    torch.manual_seed(0)
    without = run()
    assert len(spy.calls) == 4
    for a, b in zip(with_kernels, without, strict=True):
        assert_same(a, b)


def test_rms_norm_in_place_writes_into_its_inputs(ops):
    norm = make_norm(576, torch.bfloat16)
    spy = Spy(ops)
    bind([norm], spy)
    x, residual = torch.randn(333, 576, dtype=torch.bfloat16), torch.randn(333, 576).bfloat16()
    expected_out, expected_sum = norm.forward_torch(x, residual)
    out, total = norm(x, residual, in_place=True)
    assert spy.calls == ["add_rms_norm"]
    assert out is x and total is residual
    assert_same(out, expected_out)
    assert_same(total, expected_sum)


def test_layers_fall_back_on_tensors_the_kernels_do_not_take(ops):
    norm, act = make_norm(8, torch.float32), SiluAndMul()
    spy = Spy(ops)
    bind((norm, act), spy)
    x = torch.randn(8, 6).t()  # last dim not contiguous
    assert_same(norm(x), norm.forward_torch(x))
    x4 = torch.randn(2, 3, 4, 8)  # four dimensions
    assert_same(norm(x4), norm.forward_torch(x4))
    x64 = torch.randn(3, 8, dtype=torch.float64)  # a dtype the kernels do not take
    assert_same(norm(x64), norm.forward_torch(x64))
    assert_same(norm(x64, x64.clone())[0], norm.forward_torch(x64, x64.clone())[0])
    assert_same(act(x64), SiluAndMul.forward_torch(x64))
    assert spy.calls == ["declined"] * 5


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@torch.no_grad()
def test_model_forward_is_bitwise_the_same_with_and_without_kernels(ops, tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    model = load_model(path, torch.bfloat16, kernels=KernelSet(cpu=True))
    assert any(getattr(m, "ops", None) is ops for m in model.modules())
    for module in model.modules():  # the linear kernel rounds as F.linear, not bitwise:
        if hasattr(module, "packed_weight"):  # test_cpu_linear.py
            module.packed_weight = None
    input_ids = torch.randint(0, 288, (37,))
    positions = torch.arange(37) + 5
    with_kernels = model(input_ids, positions)
    bind_kernels(model, KernelSet())  # SPLITSERVE_CPU_KERNELS=0
    assert not any(getattr(m, "ops", None) for m in model.modules())
    assert_same(with_kernels, model(input_ids, positions))
