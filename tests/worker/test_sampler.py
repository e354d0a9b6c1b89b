import numpy as np
import pytest
import torch

from kernels import KernelSet
from worker.sampler import SAMPLING_EPS, Sampler, SamplingMetadata


def make_sampler(path: str, generator: torch.Generator | None = None) -> Sampler:
    """path "kernel": the C++ kernel, which must build (g++ is there in CI); "torch": the
    torch path, the reference."""
    sampler = Sampler(generator, KernelSet(cpu=path == "kernel"))
    if path == "kernel":
        assert sampler.cpu_kernel is not None, "the C++ sampling kernel did not build"
    return sampler


@pytest.fixture(params=["kernel", "torch"])
def sampler(request) -> Sampler:
    return make_sampler(request.param)


def make_metadata(temperature, top_p=None, top_k=None, min_p=None, generators=None, logprobs=None):
    temperature = torch.tensor(temperature, dtype=torch.float32)
    greedy = temperature < SAMPLING_EPS
    return SamplingMetadata(
        temperature=temperature,
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        generators=generators or {},
        max_num_logprobs=logprobs,
    )


def allowed_tokens(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, tol=1e-4):
    """Numpy reference of the tokens a row may sample: top-k, then top-p on the
    renormalised rest, then min-p. `tol` widens the set at float32-vs-float64 boundaries."""
    logits = np.asarray(logits, dtype=np.float64) / temperature
    allowed = np.ones(logits.shape, dtype=bool)
    if top_k > 0:
        allowed &= logits >= np.sort(logits)[-top_k]
    probs = np.where(allowed, np.exp(logits - logits.max()), 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.empty_like(probs)
    mass_before[order] = np.cumsum(probs[order]) - probs[order]
    allowed &= mass_before < top_p + tol
    probs = np.where(allowed, probs, 0.0)
    allowed &= probs >= min_p * probs.max() - tol
    return allowed


def test_temperature_zero_is_argmax(sampler):
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(
        sampler(logits, make_metadata([0.0] * 8)).sampled_token_ids, logits.argmax(-1)
    )
    mixed = make_metadata([0.0, 1.0] * 4, top_k=[0, 3] * 4)
    torch.manual_seed(0)
    sampled = sampler(logits, mixed).sampled_token_ids
    assert torch.equal(sampled[::2], logits[::2].argmax(-1))
    assert sampled.dtype == torch.int64 and sampled.shape == (8,)


def test_sampler_does_not_modify_logits(sampler):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    sampler(
        logits,
        make_metadata(
            [0.7, 0.0, 1.3, 1.0],
            top_p=[0.8, 1, 1, 0.5],
            top_k=[5, 0, 0, 2],
            min_p=[0.1, 0, 0, 0.2],
            logprobs=3,
        ),
    )
    assert torch.equal(logits, before)


def run_seeded(sampler, steps_logits, batch_size, target_row, seed, all_seeded):
    """Sample a seeded request (temperature 0.8, top_p 0.9) at `target_row` of a batch whose
    other rows are a mix of unseeded, other-seeded, greedy and top-k requests."""
    generators = {target_row: torch.Generator().manual_seed(seed)}
    for r in range(batch_size):
        if r != target_row and (all_seeded or r % 2):
            generators[r] = torch.Generator().manual_seed(1000 + r)
    temperature = [
        0.8 if r == target_row else (0.0 if r % 3 == 2 else 1.0) for r in range(batch_size)
    ]
    top_p = [0.9 if r == target_row else 1.0 for r in range(batch_size)]
    top_k = [0 if r == target_row else r % 4 for r in range(batch_size)]
    if all_seeded:
        temperature = [t or 1.0 for t in temperature]
    metadata = make_metadata(temperature, top_p=top_p, top_k=top_k, generators=generators)
    tokens = []
    for logits in steps_logits:
        batch = torch.randn(batch_size, logits.shape[0])
        batch[target_row] = logits
        tokens.append(int(sampler(batch, metadata).sampled_token_ids[target_row]))
    return tokens


def test_seed_gives_same_tokens_whatever_the_batch(sampler):
    torch.manual_seed(0)
    steps = [torch.randn(500) * 0.5 for _ in range(6)]
    alone = run_seeded(sampler, steps, batch_size=1, target_row=0, seed=7, all_seeded=False)
    assert run_seeded(sampler, steps, 5, 3, 7, all_seeded=False) == alone
    assert run_seeded(sampler, steps, 6, 0, 7, all_seeded=True) == alone
    assert run_seeded(sampler, steps, 4, 2, 7, all_seeded=False) == alone
    assert run_seeded(sampler, steps, 4, 2, 8, all_seeded=False) != alone


@pytest.mark.parametrize(
    "params",
    [
        dict(top_k=3),
        dict(top_p=0.6),
        dict(min_p=0.3),
        dict(temperature=0.5, top_k=10, top_p=0.8),
        dict(temperature=1.7, top_p=0.7, min_p=0.05),
        dict(temperature=2.0, top_k=12, top_p=0.95, min_p=0.2),
    ],
)
def test_filters_never_sample_outside_allowed_set(sampler, params):
    vocab, draws = 64, 512
    torch.manual_seed(1)
    logits = torch.randn(vocab) * 2
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | params
    allowed = allowed_tokens(logits.numpy(), **full, tol=0.0)
    allowed_wide = allowed_tokens(logits.numpy(), **full)
    metadata = make_metadata(
        [full["temperature"]] * draws,
        top_p=[full["top_p"]] * draws if "top_p" in params else None,
        top_k=[full["top_k"]] * draws if "top_k" in params else None,
        min_p=[full["min_p"]] * draws if "min_p" in params else None,
    )
    sampled = sampler(logits.expand(draws, vocab), metadata).sampled_token_ids.numpy()
    assert allowed_wide[sampled].all()
    # The filters do not remove too much either: every clearly allowed token shows up.
    probs = np.where(allowed, np.exp(logits.numpy() / full["temperature"]), 0)
    probs /= probs.sum()
    assert set(np.flatnonzero(probs > 0.03)) <= set(sampled.tolist())
    assert 1 < allowed.sum() < vocab


def test_mixed_batch(sampler):
    vocab, steps = 64, 150
    torch.manual_seed(2)
    logits = torch.randn(6, vocab) * 2
    # rows: greedy, seeded, unseeded, top-k, top-p, min-p
    temperature = [0.0, 0.9, 1.0, 1.0, 0.8, 1.2]
    top_k = [5, 0, 0, 4, 0, 0]  # the greedy row's top-k is ignored
    top_p = [1.0, 1.0, 1.0, 1.0, 0.7, 1.0]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.0, 0.25]
    allowed = [
        allowed_tokens(logits[r].numpy(), temperature[r] or 1.0, top_k[r], top_p[r], min_p[r])
        for r in range(6)
    ]
    batch = make_metadata(temperature, top_p, top_k, min_p, {1: torch.Generator().manual_seed(3)})
    solo = make_metadata([0.9], generators={0: torch.Generator().manual_seed(3)})
    seen = [set() for _ in range(6)]
    for _ in range(steps):
        sampled = sampler(logits, batch).sampled_token_ids.tolist()
        assert sampled[1] == int(sampler(logits[1:2], solo).sampled_token_ids[0])
        for r, token in enumerate(sampled):
            assert allowed[r][token]
            seen[r].add(token)
    assert seen[0] == {int(logits[0].argmax())}
    assert all(len(s) > 1 for s in seen[1:])


def test_sampling_frequencies_follow_the_distribution(sampler):
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    n = 8000
    logits = torch.tensor(np.log(probs), dtype=torch.float32).expand(3 * n, 4)
    metadata = make_metadata([1.0] * n + [0.5] * n + [1.0] * n, top_p=[1.0] * 2 * n + [0.65] * n)
    torch.manual_seed(3)
    sampled = sampler(logits, metadata).sampled_token_ids.numpy().reshape(3, n)
    expected = [probs, probs**2 / (probs**2).sum(), np.array([0, 0, 3, 4]) / 7]
    for group, p in zip(sampled, expected, strict=True):
        np.testing.assert_allclose(np.bincount(group, minlength=4) / n, p, atol=0.02)


def test_logprobs_are_raw_log_softmax(sampler):
    torch.manual_seed(4)
    logits = torch.randn(6, 40) * 3
    reference = torch.log_softmax(logits.double(), dim=-1).numpy()
    metadata = make_metadata([0.0, 0.5, 1.0, 2.0, 1.0, 0.0], top_k=[0, 3, 0, 0, 2, 0], logprobs=5)
    out = sampler(logits, metadata)
    token_ids, logprobs, ranks = out.logprobs
    assert token_ids.shape == logprobs.shape == (6, 6)
    assert torch.equal(token_ids[:, 0], out.sampled_token_ids)
    np.testing.assert_array_equal(token_ids[:, 1:].numpy(), np.argsort(-reference, axis=1)[:, :5])
    np.testing.assert_allclose(
        logprobs.numpy(), np.take_along_axis(reference, token_ids.numpy(), axis=1), atol=1e-5
    )
    # Each sampled token's rank: 1 + the tokens more likely than it.
    order = np.argsort(-reference, axis=1)
    want = [int(np.nonzero(order[i] == t)[0][0]) + 1 for i, t in enumerate(token_ids[:, 0])]
    assert ranks.tolist() == want and ranks.tolist()[0] == 1  # row 0 is greedy
    only_sampled = sampler(logits, make_metadata([0.0] * 6, logprobs=0)).logprobs
    assert only_sampled.token_ids.shape == (6, 1)
    assert sampler(logits, make_metadata([0.0] * 6)).logprobs is None
