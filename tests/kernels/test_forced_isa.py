"""Every C++ kernel built for a lower ISA than this CPU's (SPLITSERVE_CPU_ISA), against the
torch code it replaces: the fused layer kernels, paged attention and sampling. The builds
land in folders of their own, so each path runs on one machine; an ISA above this CPU's is
skipped."""

import pytest
import torch

from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from kernels import KernelSet, probe_isa
from kernels.isa import runnable_isas
from models import load_model
from models.layers.activation import SiluAndMul
from models.layers.cpu_linear import dense_linear_kernel, linear_kernel
from models.layers.fused_ops import fused_ops
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, apply_rotary
from tests.attention.paged_requests import PagedRequests
from tests.models.linear_check import check
from tests.models.tiny import make_tiny_checkpoint
from worker.sampler import Sampler, SamplingMetadata

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module", params=["avx2", "generic"])
def kernels(request) -> KernelSet:
    if request.param not in runnable_isas():
        pytest.skip(f"this CPU cannot run {request.param} kernels (it has {probe_isa()})")
    return KernelSet(cpu=True, isa=request.param)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layer_kernels(kernels, dtype):
    """Norms and rotary bitwise; SiLU too in bf16 and fp16, within two ulps in float32 (the
    build's exp is not torch's own, whose width its runtime dispatch picks)."""
    ops = fused_ops(kernels)
    assert ops is not None and ops.__name__ == f"splitserve_kernels_{kernels.isa}.ops"
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(600, eps=1e-6)
    norm.weight.data = torch.randn(600, generator=gen).to(dtype)
    x, residual = (torch.randn(33, 600, generator=gen).to(dtype) * 3 for _ in range(2))
    assert torch.equal(ops.rms_norm(x, norm.weight, 1e-6), norm.forward_torch(x))
    out, total = torch.empty_like(x), torch.empty_like(x)
    assert ops.add_rms_norm(x, residual, norm.weight, 1e-6, out, total)
    expected_out, expected_total = norm.forward_torch(x, residual)
    assert torch.equal(out, expected_out) and torch.equal(total, expected_total)
    gate_up = torch.randn(33, 2 * 1000, generator=gen).to(dtype) * 4
    silu, expected = ops.silu_and_mul(gate_up), SiluAndMul.forward_torch(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(silu, expected, rtol=5e-7, atol=1e-30)
    else:
        assert torch.equal(silu, expected)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64))
    rope = RotaryEmbedding(64, 512, inv_freq, attention_scaling=1.1)
    positions = torch.randint(0, 512, (33,), generator=gen)
    q, k = torch.randn(33, 9 * 64, generator=gen).to(dtype), torch.randn(33, 3 * 64).to(dtype)
    cos, sin = rope.get_cos_sin(positions, dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin, 64), apply_rotary(k, cos, sin, 64)
    assert ops.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, 64)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_paged_attention(kernels, dtype, head_dim):
    """Decodes, short rows (decode-kernel entries: one crossing a page, a fresh prompt), a
    chunked prefill with a cached prefix and a fresh prompt through the CPU backend, K/V
    stored by its C++ copy, against the torch backend."""
    module = load_cpu_attention(kernels)
    assert module is not None and not module.has_amx_path()
    reqs = PagedRequests([70, 33, 40, 9, 19, 3], 8, 2, head_dim, 16, dtype=dtype)
    for req, length in ((0, 69), (1, 32), (2, 10), (4, 14)):
        reqs.cache_prefix(req, length)
    schedule = [(0, 69, 1), (4, 14, 5), (1, 32, 1), (2, 10, 30), (5, 0, 3), (3, 0, 9)]
    expected = reqs.run_step(TorchAttentionBackend(), schedule)
    got = reqs.run_step(CPUAttentionBackend(module), schedule)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted, **tolerance)


def test_sampling(kernels):
    """The same tokens as the torch path from the same draws: greedy rows and random rows
    with temperature, top-k, top-p and min-p."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * 16)
    metadata = SamplingMetadata(
        temperature=temperature,
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0] * 16),
        top_k=torch.tensor([0, 50, 0, 5] * 16, dtype=torch.int32),
        min_p=torch.tensor([0.0, 0.0, 0.05, 0.0] * 16),
        all_greedy=False,
        all_random=False,
        generators={},
        max_num_logprobs=None,
    )
    sampler = Sampler(torch.Generator().manual_seed(7), kernels)
    assert sampler.cpu_kernel is not None
    reference = Sampler(torch.Generator().manual_seed(7), KernelSet())
    sampled = sampler(logits, metadata).sampled_token_ids
    assert torch.equal(sampled, reference(logits, metadata).sampled_token_ids)
    assert torch.equal(sampled[::4], logits[::4].argmax(-1))


@pytest.mark.parametrize("rows", [3, 40, 775])  # dot tiles, panels, the packed GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_linear_kernel(kernels, rows, dtype):
    """Each of its paths on float32 and bf16 weights against float64 (every shape at the
    CPU's own rung in tests/models/test_cpu_dense_linear.py)."""
    ops = dense_linear_kernel(kernels)
    assert ops is not None and ops.__name__ == f"splitserve_kernels_{kernels.isa}.dense_linear"
    torch.manual_seed(rows)
    x, w, bias = torch.randn(rows, 200), torch.randn(77, 200).to(dtype), torch.randn(77)
    check(ops.dense_linear(x, w, bias), x, w, bias)


@torch.no_grad()
def test_a_model_loaded_with_the_set(kernels, tmp_path):
    """Its layers hold the forced ISA's kernels (no AMX linear kernel below amx: the bf16
    weights on the dense kernel, as no bf16 instructions are below avx512_bf16), and
    its forward matches the torch code's given the same linear kernels (those are tested
    against float64 in tests/models/test_cpu_dense_linear.py)."""
    path = make_tiny_checkpoint(
        tmp_path, "qwen3", hidden_size=96, num_attention_heads=3, num_key_value_heads=1
    )
    model = load_model(path, torch.bfloat16, kernels=kernels)
    assert linear_kernel(kernels) is None
    packed = [m.packed_weight for m in model.modules() if hasattr(m, "packed_weight")]
    assert packed and all(p is not None and not p.amx for p in packed)
    assert {p.kernel.__name__ for p in packed} == {f"splitserve_kernels_{kernels.isa}.dense_linear"}
    ops = {getattr(m, "ops", None) for m in model.modules()} - {None}
    assert [module.__name__ for module in ops] == [f"splitserve_kernels_{kernels.isa}.ops"]
    reference = load_model(path, torch.bfloat16, kernels=KernelSet())
    for ours, theirs in zip(model.modules(), reference.modules(), strict=True):
        if hasattr(ours, "packed_weight"):
            theirs.packed_weight = ours.packed_weight
    input_ids, positions = torch.randint(0, 288, (37,)), torch.arange(37)
    assert torch.equal(model(input_ids, positions), reference(input_ids, positions))
