"""The rejection sampler for drafts drawn from a draft distribution q: through the Sampler
(settings applied to p) and the accept rule, every produced token is distributed as the
target's p at its position, for random p and q (chi-square), and drafts are accepted with
probability sum_x min(p(x), q(x))."""

import numpy as np
import pytest
import torch

from tests.worker.sampler_helpers import chi_square_ok
from worker.rejection_sampler import DraftProbs, rejection_sample
from worker.sampler import Sampler, SamplingMetadata
from worker.step_output import DraftVerification

VOCAB, K, TRIALS = 6, 2, 20000


def _metadata(num_rows: int, temperature: float, top_k: int | None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature),
        top_p=None,
        top_k=None if top_k is None else torch.full((num_rows,), top_k),
        min_p=None,
        all_greedy=False,
        all_random=True,
        generators={},
        max_num_logprobs=None,
    )


def _target(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """p by hand: temperature, then the top k renormalised."""
    p = (logits / temperature).softmax(-1)
    if top_k is not None:
        threshold = p.topk(top_k, dim=-1).values[:, -1:]
        p = torch.where(p >= threshold, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


@pytest.mark.parametrize(
    ("seed", "temperature", "top_k"), [(0, 1.0, None), (1, 0.7, 4), (2, 1.3, None)]
)
def test_produced_tokens_follow_the_target_distribution(seed, temperature, top_k):
    rng = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, VOCAB, generator=rng) * 1.5
    p = _target(logits, temperature, top_k)
    q = (torch.randn(K, VOCAB, generator=rng) * 1.5).softmax(-1)
    drafts = torch.stack(
        [torch.multinomial(q[j], TRIALS, True, generator=rng) for j in range(K)], 1
    )
    metadata = _metadata((K + 1) * TRIALS, temperature, top_k)
    metadata.draft_probs = DraftProbs(
        torch.arange(TRIALS) * (K + 1),
        torch.full((TRIALS,), K),
        drafts,
        q.expand(TRIALS, K, VOCAB),
    )
    sampler = Sampler(torch.Generator().manual_seed(seed + 100))
    sampled = sampler(logits.repeat(TRIALS, 1), metadata).sampled_token_ids.tolist()
    verification = DraftVerification(np.full(TRIALS, K + 1), drafts.tolist(), {})
    produced = [t for _, t in verification.accept(sampled)]

    first = np.bincount([t[0] for t in produced], minlength=VOCAB)
    assert first[(p[0] == 0).numpy()].sum() == 0
    assert chi_square_ok(first, p[0].numpy())
    accept_rate = torch.minimum(p[0], q[0]).sum().item()
    num_accepted = sum(len(t) > 1 for t in produced)
    spread = 5 * (TRIALS * accept_rate * (1 - accept_rate)) ** 0.5 + 1
    assert abs(num_accepted - accept_rate * TRIALS) < spread
    # After an accepted first draft (whatever it was), the next token follows p[1].
    second = np.bincount([t[1] for t in produced if len(t) > 1], minlength=VOCAB)
    assert second[(p[1] == 0).numpy()].sum() == 0
    assert chi_square_ok(second, p[1].numpy())


def test_equal_p_and_q_accept_every_draft_and_a_rejection_never_repeats_the_draft():
    rng = torch.Generator().manual_seed(7)
    p = (torch.randn(3, K + 1, VOCAB, generator=rng)).softmax(-1)
    drafts = DraftProbs(
        torch.zeros(3),
        torch.tensor([2, 1, 2]),
        torch.tensor([[1, 2], [3, 0], [4, 4]]),
        p[:, :K].clone(),
    )
    u = torch.rand(3, K, generator=rng)
    num_accepted, _ = rejection_sample(p, drafts, u, torch.rand(3, generator=rng))
    assert num_accepted.tolist() == [2, 1, 2]
    # q puts all mass on the draft where p has little: the draft is rejected (u > p/q),
    # and the residual p - q has no mass on it.
    q = torch.zeros(3, K, VOCAB)
    q[:, :, 5] = 1.0
    p = torch.full((3, K + 1, VOCAB), 1.0 / VOCAB)
    drafts = DraftProbs(torch.zeros(3), torch.tensor([2, 2, 2]), torch.full((3, K), 5), q)
    num_accepted, token = rejection_sample(p, drafts, torch.full((3, K), 0.9), torch.rand(3))
    assert num_accepted.tolist() == [0, 0, 0] and 5 not in token.tolist()
