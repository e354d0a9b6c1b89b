"""The fused-experts kernels (models/layers/moe_experts.py): the torch path and the C++
kernel against a float64 reference that loops over each token and each of its experts,
over random routings (experts without tokens, ids of -1 for experts on other ranks)."""

import pytest
import torch
import torch.nn.functional as F

from models.layers.moe_experts import fused_experts_torch

HIDDEN, INTER, EXPERTS = 64, 48, 6


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
    """Random distinct experts per token (some experts get none when few tokens), softmax
    weights, and a fraction `absent` of the ids set to -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g).softmax(dim=1)
    off = torch.rand(num_tokens, top_k, generator=g) < absent
    return weights.float(), torch.where(off, -1, ids).long()


def problem(num_tokens, top_k, dtype, seed=0, absent=0.0, hidden=HIDDEN, inter=INTER):
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return (x, w13, w2, *routing(num_tokens, top_k, seed, absent=absent))


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
CASES = [(t, k) for t in (0, 1, 3, 64) for k in (1, 2, 4) if k <= EXPERTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k", CASES)
@pytest.mark.parametrize("absent", [0.0, 0.3])
def test_torch_path_matches_reference(num_tokens, top_k, dtype, absent):
    args = problem(num_tokens, top_k, dtype, seed=num_tokens * 10 + top_k, absent=absent)
    out = fused_experts_torch(*args)
    assert out.dtype == dtype and out.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(out.double(), reference(*args), **TOLERANCE[dtype])
