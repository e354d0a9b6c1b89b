"""The fused-experts kernels (models/layers/moe_experts.py): the torch path and the C++
kernel (cpu_moe.cpp) against a float64 reference that loops over each token and each of its
experts, over random routings (experts without tokens, ids of -1 for experts on other
ranks). Sizes that are no multiple of the kernel's 16-wide steps or of its feature tiles
take its tails. The kernel is built for the baseline ISA (the generic path), AVX2 (the
float32-math vector path, which AVX-512F builds run too), AVX-512 BF16 (bf16 tiles for
bf16 weights, which AMX builds run too) and this CPU's own, where it has them; a lower ISA
is forced with KernelSet(isa=...), as SPLITSERVE_CPU_ISA forces it in a worker."""

import pytest
import torch
import torch.nn.functional as F

from kernels import KernelSet, probe_isa
from kernels.isa import rungs
from models.layers import moe_experts
from models.layers.moe_experts import fused_experts, fused_experts_torch, moe_kernel

HIDDEN, INTER, EXPERTS = 72, 40, 6  # 4 steps of 16 and 8 left over; 2 steps and 8


def reference(x, w13, w2, topk_weights, topk_ids):
    """out[t] = sum_j weight[t, j] * w2[e] @ (silu(gate_e . x[t]) * (up_e . x[t])), float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gate_up = w13[e] @ x[t]
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[e] @ h)
    return out


def routing(num_tokens, top_k, seed, experts=EXPERTS, absent=0.0):
    """Distinct random experts per token (with few tokens some experts get none), softmax
    weights, and a fraction `absent` of the ids set to -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g).softmax(dim=1)
    off = torch.rand(num_tokens, top_k, generator=g) < absent
    return weights.float(), torch.where(off, -1, ids).long()


def problem(num_tokens, top_k, dtype, seed=0, absent=0.0, experts=EXPERTS):
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, INTER, generator=g) / INTER**0.5).to(dtype)
    return (x, w13, w2, *routing(num_tokens, top_k, seed, experts, absent))


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16]
# (tokens, top_k, experts): decode (one token, few of many experts), a few tokens, a batch
# whose experts get more than the kernel's 4-row tiles, and 150 tokens on 2 experts (more
# rows than one of the kernel's 64-row chunks).
CASES = [(0, 2, 6), (1, 1, 6), (1, 2, 16), (3, 2, 6), (3, 8, 8), (64, 1, 6), (64, 8, 16)]
CASES += [(150, 2, 2)]


def kernel_isas():
    """generic, avx2, avx512_bf16 and this CPU's own ISA, those of them it has."""
    own = probe_isa()
    return [r for r in rungs(own) if r in ("generic", "avx2", "avx512_bf16", own)]


@pytest.fixture(scope="module", params=kernel_isas())
def kernel(request):
    """The C++ module built for the ISA."""
    module = moe_kernel(KernelSet(cpu=True, isa=request.param))
    assert module is not None, "the C++ kernels must build wherever the tests run (g++)"
    return module


def run_case(function, num_tokens, top_k, experts, dtype, absent):
    args = problem(
        num_tokens, top_k, dtype, seed=num_tokens * 10 + top_k, absent=absent, experts=experts
    )
    out = function(*args)
    assert out.dtype == dtype and out.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(out.double(), reference(*args), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,experts", CASES)
@pytest.mark.parametrize("absent", [0.0, 0.3])
def test_torch_path_matches_reference(num_tokens, top_k, experts, dtype, absent):
    run_case(fused_experts_torch, num_tokens, top_k, experts, dtype, absent)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,top_k,experts", CASES)
@pytest.mark.parametrize("absent", [0.0, 0.3])
def test_kernel_matches_reference(kernel, num_tokens, top_k, experts, dtype, absent):
    run_case(kernel.fused_experts, num_tokens, top_k, experts, dtype, absent)


def test_kernel_with_every_id_absent_or_one_expert(kernel):
    """No pair on this rank: zeros; every token on one expert: the tiles split its rows."""
    x, w13, w2, weights, ids = problem(5, 2, torch.float32)
    assert torch.equal(
        kernel.fused_experts(x, w13, w2, weights, torch.full_like(ids, -1)), torch.zeros_like(x)
    )
    ids = torch.full_like(ids, 3)
    torch.testing.assert_close(
        kernel.fused_experts(x, w13, w2, weights, ids).double(),
        reference(x, w13, w2, weights, ids),
        **TOLERANCE[torch.float32],
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_in_chunks_of_tokens(kernel, dtype):
    """Beyond its workspace the kernel runs chunks of tokens: forced to 7 tokens, the same
    result as in one chunk."""
    args = problem(30, 2, dtype, absent=0.2)
    whole = kernel.fused_experts(*args)
    assert torch.equal(kernel.fused_experts(*args, chunk_tokens=7), whole)
    torch.testing.assert_close(whole.double(), reference(*args), **TOLERANCE[dtype])


def test_kernel_takes_strided_x_and_int32_ids(kernel):
    x, w13, w2, weights, ids = problem(7, 2, torch.float32)
    wide = torch.zeros(7, 2 * HIDDEN)
    wide[:, ::2] = x
    out = kernel.fused_experts(wide[:, ::2], w13, w2, weights, ids.int())
    torch.testing.assert_close(
        out.double(), reference(x, w13, w2, weights, ids), **TOLERANCE[torch.float32]
    )


def test_kernel_declines_what_it_does_not_take(kernel):
    """float16, mixed dtypes and strided weights return None (the torch path runs)."""
    x, w13, w2, weights, ids = problem(3, 2, torch.float32)
    assert kernel.fused_experts(x.half(), w13.half(), w2.half(), weights, ids) is None
    assert kernel.fused_experts(x.bfloat16(), w13, w2, weights, ids) is None
    assert (
        kernel.fused_experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
        is None
    )


def test_expert_id_out_of_range_raises(kernel):
    x, w13, w2, weights, ids = problem(3, 2, torch.float32)
    ids[1, 0] = EXPERTS
    with pytest.raises(ValueError, match="expert"):
        kernel.fused_experts(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="expert"):
        fused_experts_torch(x, w13, w2, weights, ids)


def test_fused_experts_takes_the_kernel_when_the_set_has_it(monkeypatch):
    """With the C++ kernels on, fused_experts calls the module; off, or for dtypes the
    kernel declines, it runs the torch path."""
    module = moe_kernel(KernelSet(cpu=True))
    assert module is not None
    calls = []

    def spy(*args):
        calls.append(args[0].dtype)
        return module_function(*args)

    module_function = module.fused_experts
    monkeypatch.setattr(module, "fused_experts", spy)
    torch_calls = []
    monkeypatch.setattr(
        moe_experts,
        "fused_experts_torch",
        lambda *a: torch_calls.append(a[0].dtype) or fused_experts_torch(*a),
    )
    args = problem(4, 2, torch.float32)
    expected = reference(*args)
    for kernels in (KernelSet(cpu=True), None, KernelSet()):
        out = fused_experts(*args, kernels=kernels)
        torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])
    assert calls == [torch.float32] and torch_calls == [torch.float32] * 2
    half = tuple(a.half() if a.is_floating_point() and a is not args[3] else a for a in args)
    fused_experts(*half, kernels=KernelSet(cpu=True))
    assert calls[-1] == torch.float16 and torch_calls[-1] == torch.float16
