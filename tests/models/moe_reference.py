"""The float64 reference of the fused-MoE kernel tests (the dense Triton kernels and the
quantized ones), their routings and small tiles."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.layers.triton_moe import Tiles

SMALL_TILES = Tiles(16, 32, 32, 4, 1)  # several K steps and column blocks at tiny shapes


def reference(x, w13, w2, topk_weights, topk_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, magnitude) in float64, token by token and slot by slot: magnitude bounds the
    size of what the roundings of the experts' intermediates and outputs carry into out."""
    x, w13, w2 = x.cpu().double(), w13.cpu().double(), w2.cpu().double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    magnitude = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            weight = float(topk_weights[t, j])
            h = w13[e] @ x[t]
            slot = w2[e] @ (F.silu(h[:inter]) * h[inter:])
            out[t] += weight * slot
            # Bounds |gate| * |up| (and their dots' float32 summation error): the size of
            # what the roundings of gate, up, silu(gate) and the product carry.
            h_size = w13[e].abs() @ x[t].abs()
            carried = h_size[:inter] * h_size[inter:]
            magnitude[t] += weight * (w2[e].abs() @ carried + slot.abs())
    return out, magnitude


def routing(num_tokens: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(topk_weights, topk_ids): k distinct experts per token, never expert `seed % E` when
    k < E (an expert with no token), about a quarter of the ids -1 (on another rank)."""
    gen = torch.Generator().manual_seed(seed)
    skipped = seed % experts if top_k < experts else experts
    choices = torch.tensor([e for e in range(experts) if e != skipped])
    ids = torch.stack(
        [choices[torch.randperm(len(choices), generator=gen)[:top_k]] for _ in range(num_tokens)]
    )
    ids[torch.rand(ids.shape, generator=gen) < 0.25] = -1
    weights = torch.rand(ids.shape, generator=gen, dtype=torch.float32)
    return weights, ids
