"""The sampler's distributions against exact numpy ones, and the C++ kernel against the
torch path: same draws, same tokens."""

import numpy as np
import pytest
import torch

from tests.worker.sampler_helpers import (
    CASES,
    LOGITS,
    chi_square_ok,
    exact_probs,
    make_metadata,
    make_sampler,
    masked_batch,
    random_settings,
)
from worker.sampler import skip_sample_draws


@pytest.fixture(params=["kernel", "torch"])
def path(request) -> str:
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_frequencies_fit_the_exact_distribution(path, dtype, case):
    temperature, top_k, top_p, min_p = case
    n = 4000
    probs = exact_probs(LOGITS, *case)
    logits = torch.tensor(LOGITS, dtype=dtype).expand(n, len(LOGITS))
    metadata = make_metadata(
        [temperature] * n,
        top_p=[top_p] * n if top_p < 1 else None,
        top_k=[top_k] * n if top_k else None,
        min_p=[min_p] * n if min_p else None,
    )
    sampler = make_sampler(path, torch.Generator().manual_seed(17 + CASES.index(case)))
    sampled = sampler(logits, metadata).sampled_token_ids.numpy()
    counts = np.bincount(sampled, minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0
    assert chi_square_ok(counts, probs), (counts, np.round(probs * n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_torch_pick_the_same_tokens(dtype):
    """Both paths draw the same uniforms. They pick different tokens only where the draw
    or a filter boundary falls within float rounding (~1e-6) of a token's edge, or, in
    bf16, where top-p's boundary falls in a run of equal logits (the kernel keeps the
    whole run, the torch path a sort-dependent part of it): such rows are left out."""
    rows, vocab = 3000, 2000
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    kind, metadata = random_settings(rows, seed=6)
    kernel = make_sampler("kernel", torch.Generator().manual_seed(7))
    reference = make_sampler("torch", torch.Generator().manual_seed(7))
    fast = kernel(logits, metadata).sampled_token_ids.numpy()
    slow = reference(logits, metadata).sampled_token_ids.numpy()
    greedy = kind == 0
    np.testing.assert_array_equal(fast[greedy], logits[greedy].float().argmax(-1).numpy())
    np.testing.assert_array_equal(fast[greedy], slow[greedy])
    compared = ~np.isin(kind, [3, 5]) if dtype == torch.bfloat16 else np.ones(rows, bool)
    agree = (fast == slow)[compared]
    assert agree.mean() >= 0.999, np.flatnonzero(compared)[~agree]


def test_top_k_keeps_ties_in_both_paths():
    """Integer logits: the k-th largest has many equals, all kept by both paths."""
    rows, vocab = 400, 3000
    generator = torch.Generator().manual_seed(8)
    logits = torch.randint(-20, 20, (rows, vocab), generator=generator).float()
    metadata = make_metadata([1.0] * rows, top_k=[3, 10, 40, 700] * (rows // 4))
    kernel = make_sampler("kernel", torch.Generator().manual_seed(9))
    reference = make_sampler("torch", torch.Generator().manual_seed(9))
    fast = kernel(logits, metadata).sampled_token_ids
    assert torch.equal(fast, reference(logits, metadata).sampled_token_ids)
    kth = logits.sort(dim=-1, descending=True).values[torch.arange(rows), metadata.top_k - 1]
    assert (logits[torch.arange(rows), fast] >= kth).all()


def test_seeded_rows_match_across_paths_and_replays(path):
    """A seeded row draws one uniform per sample from its own generator, whichever path
    samples and whatever else is in the batch; skip_sample_draws replays those draws."""
    vocab, steps, seed = 300, 8, 11
    generator = torch.Generator().manual_seed(12)
    logits = [torch.randn(vocab, generator=generator) for _ in range(steps)]

    def sample_alone(sampler_path: str) -> list[int]:
        sampler = make_sampler(sampler_path)
        alone = make_metadata([0.9], [0.95], generators={0: torch.Generator().manual_seed(seed)})
        return [int(sampler(row[None], alone).sampled_token_ids[0]) for row in logits]

    tokens = sample_alone(path)
    assert sample_alone("torch") == tokens
    replayed = torch.Generator().manual_seed(seed)
    skip_sample_draws(replayed, steps // 2)
    batch = make_metadata(
        [1.0, 0.0, 0.9, 0.7],
        top_p=[1.0, 1.0, 0.95, 0.5],
        top_k=[5, 0, 0, 3],
        generators={2: replayed, 3: torch.Generator().manual_seed(13)},
    )
    sampler = make_sampler(path)
    for step in range(steps // 2, steps):
        others = torch.randn(3, vocab)
        rows = torch.cat([others[:2], logits[step][None], others[2:]])
        assert int(sampler(rows, batch).sampled_token_ids[2]) == tokens[step]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_tokens_are_never_sampled(path, dtype):
    """-inf logits (allowed_token_ids, min_tokens) have no mass in any filter; a row with
    one finite logit always samples it."""
    rows, vocab = 600, 5000
    odd = torch.arange(1, rows, 2)
    logits, keep, metadata = masked_batch(rows, vocab, 0.01, odd)
    sampler = make_sampler(path, torch.Generator().manual_seed(15))
    sampled = sampler(logits.to(dtype), metadata).sampled_token_ids
    assert keep[torch.arange(rows), sampled].all()
    assert torch.equal(sampled[odd], odd * 7)


def test_a_model_sized_batch():
    """A 49k vocabulary with a model's shape of logits (a heavy upper tail): top-k takes the
    kernel's block path there (not the radix one) and top-p skips most blocks."""
    rows, vocab = 96, 49152
    generator = torch.Generator().manual_seed(16)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    tail = torch.randint(0, vocab, (rows, 300), generator=generator)
    logits.scatter_add_(1, tail, 4 + 12 * torch.rand(rows, 300, generator=generator))
    metadata = make_metadata(
        [0.6] * rows,
        top_p=[1.0, 1.0, 0.9, 0.5, 1.0, 0.95] * (rows // 6),
        top_k=[20, 150, 0, 0, 0, 50] * (rows // 6),
        min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.02] * (rows // 6),
    )
    kernel = make_sampler("kernel", torch.Generator().manual_seed(17))
    reference = make_sampler("torch", torch.Generator().manual_seed(17))
    sampled = kernel(logits, metadata).sampled_token_ids
    assert torch.equal(sampled, reference(logits, metadata).sampled_token_ids)
    ranks = (logits > logits[torch.arange(rows), sampled].unsqueeze(1)).sum(-1)
    top_k = metadata.top_k.masked_fill(metadata.top_k == 0, vocab)
    assert (ranks < top_k).all()
