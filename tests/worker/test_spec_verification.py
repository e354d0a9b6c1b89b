"""Draft verification on the worker: the accept rule, its distribution (chi-square against
the target's), seeded streams set back to one draw per produced token, and sampling
settings that follow each position's tokens so far (penalties, min_tokens, bad words)."""

import numpy as np
import pytest
import torch

from ipc.sampling_params import SamplingParams
from worker.input_batch import CachedRequestState, InputBatch
from worker.sampler import Sampler, SamplingMetadata, skip_sample_draws
from worker.step_output import DraftVerification


def verification(num_logits, drafts, states=None):
    return DraftVerification(np.array(num_logits), drafts, states or {})


def test_accept_keeps_matching_drafts_then_one_sampled_token():
    v = verification([4, 1, 3, 3], [[5, 6, 7], [], [1, 2], [8, 9]])
    sampled = [5, 6, 0, 3] + [4] + [1, 2, 9] + [7, 9, 9]
    assert v.accept(sampled) == [(0, [5, 6, 0]), (4, [4]), (5, [1, 2, 9]), (8, [7])]


# The chi-square distribution's 0.999 quantile at 5 degrees of freedom: a correct sampler
# exceeds it once in a thousand runs (the seeds below are fixed).
CHI2_5_999 = 20.515


def chi_square(observed: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def _metadata(num_rows: int, generators=None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(num_rows),
        top_p=None,
        top_k=None,
        min_p=None,
        all_greedy=False,
        all_random=True,
        generators=generators or {},
        max_num_logprobs=None,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verified_tokens_follow_the_target_distribution(seed):
    """A point-mass draft d against target p at two positions: the first produced token is
    distributed as p; d is accepted with probability p(d); after an accepted d the next
    token is distributed as the second position's p (chi-square, 20000 draws)."""
    rng = torch.Generator().manual_seed(seed)
    vocab, trials = 6, 20000
    logits = torch.randn(2, vocab, generator=rng) * 1.5
    p = logits.softmax(-1)
    draft = int(torch.randint(vocab, (1,), generator=rng))
    sampler = Sampler(torch.Generator().manual_seed(seed + 100))
    batch_logits = logits.repeat(trials, 1)  # trials rows verifying one draft each
    sampled = sampler(batch_logits, _metadata(2 * trials)).sampled_token_ids.tolist()
    accepted = verification([2] * trials, [[draft]] * trials).accept(sampled)
    first = np.bincount([tokens[0] for _, tokens in accepted], minlength=vocab)
    assert chi_square(first, p[0].numpy()) < CHI2_5_999
    num_accepted = sum(len(tokens) == 2 for _, tokens in accepted)
    expected = p[0, draft].item() * trials
    assert abs(num_accepted - expected) < 5 * (expected * (1 - p[0, draft].item())) ** 0.5 + 1
    second = np.bincount([t[1] for _, t in accepted if len(t) == 2], minlength=vocab)
    assert chi_square(second, p[1].numpy()) < CHI2_5_999


def test_a_seeded_stream_is_set_back_to_one_draw_per_produced_token():
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    for _ in range(4):  # the step drew for 4 positions
        torch.empty(1).uniform_(generator=generator)
    v = verification([4], [[1, 2, 3]], {0: (generator, state)})
    assert v.accept([1, 7, 0, 0]) == [(0, [1, 7])]
    expected = torch.Generator().manual_seed(5)
    skip_sample_draws(expected, 2)
    assert torch.equal(generator.get_state(), expected.get_state())


def test_each_position_sees_the_drafts_before_it():
    vocab = 16
    batch = InputBatch(
        max_num_reqs=4, max_model_len=32, max_num_blocks_per_req=4, block_size=8,
        device="cpu", vocab_size=vocab, eos_token_ids=[2],
    )  # fmt: skip
    params = SamplingParams(
        temperature=1.0, presence_penalty=1.0, min_tokens=3, bad_words_token_ids=[[5, 6]]
    )
    state = CachedRequestState("r", [1, 1], params, None, [[1]], 2, output_token_ids=[9])
    batch.add_request(state)
    batch.set_draft_tokens({"r": [5, 9]})
    rows, offsets = np.array([0, 0, 0]), np.array([0, 1, 2])
    metadata = batch.make_sampling_metadata(rows, offsets)
    # Outputs so far: [9], [9, 5], [9, 5, 9]; min_tokens 3 lets the fourth output stop.
    assert sorted(metadata.blocked_token_ids) == [0, 1]
    outputs = metadata.penalties.output_token_ids.tolist()
    assert [[t for t in row if t < vocab] for row in outputs] == [[9], [9, 5], [9, 5, 9]]
    # "5 6": 6 is banned right after the draft 5 only.
    assert metadata.bad_words.rows.tolist() == [1]
    assert metadata.bad_words.token_ids.tolist() == [6]
    assert batch.num_tokens[0] == 3  # drafts are not tokens of the row
    batch.set_draft_tokens({})
    assert batch.num_draft_tokens[0] == 0
