"""What the sampler tests share: a sampler on either path, SamplingMetadata from lists,
numpy references of the allowed tokens and their exact distribution, a chi-square test,
and a batch with most tokens masked."""

import math

import numpy as np
import torch

from kernels import KernelSet
from worker.sampler import SAMPLING_EPS, Sampler, SamplingMetadata

# Exact in bf16 and fp32, and no filter boundary of the cases below is within 1e-3.
LOGITS = [0.75, -1.5, 2.0, 0.0, 1.25, -0.25, 3.0, -1.0, 1.5, 0.5, 2.25, -0.75]

CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (2.0, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (0.7, 7, 1.0, 0.0),
    (1.0, 0, 0.6, 0.0),
    (1.5, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.8, 0, 1.0, 0.3),
    (0.8, 6, 0.8, 0.05),
    (1.3, 8, 0.95, 0.15),
    (1.0, 0, 0.95, 0.15),
    (1.0, 4, 0.5, 0.0),
]


# One row of each: greedy, temperature, top-k, top-p, min-p, and all three filters.
_MIXED_SETTINGS = [  # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.6, 100, 1.0, 0.0),
    (1.5, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.2),
    (2.0, 60, 0.95, 0.05),
]


def make_sampler(path: str, generator: torch.Generator | None = None) -> Sampler:
    """path "kernel": the C++ kernel, which must build (g++ is there in CI); "torch": the
    torch path, the reference."""
    sampler = Sampler(generator, KernelSet(cpu=path == "kernel"))
    if path == "kernel":
        assert sampler.cpu_kernel is not None, "the C++ sampling kernel did not build"
    return sampler


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


def metadata_of(settings: list[tuple[float, int, float, float]]) -> SamplingMetadata:
    """SamplingMetadata of rows with these (temperature, top_k, top_p, min_p)."""
    temperature, top_k, top_p, min_p = (list(column) for column in zip(*settings, strict=True))
    return make_metadata(temperature, top_p, top_k, min_p)


def masked_batch(
    rows: int, vocab: int, keep_fraction: float, single: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, SamplingMetadata]:
    """(logits, keep, metadata): random logits with all but about `keep_fraction` of each
    row at -inf (even rows keep token 0), each row r in `single` keeping only token 7 * r,
    at -30; the rows take turns at greedy, temperature, top-k, top-p, min-p and all three
    filters (rows: a multiple of 6)."""
    generator = torch.Generator().manual_seed(14)
    logits = torch.randn(rows, vocab, generator=generator) * 2
    keep = torch.rand(rows, vocab, generator=generator) < keep_fraction
    keep[0::2, 0] = True
    keep[single] = False
    keep[single, single * 7] = True
    logits = logits.masked_fill(~keep, float("-inf"))
    logits[single, single * 7] = -30.0
    return logits, keep, metadata_of(_MIXED_SETTINGS * (rows // 6))


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


def exact_probs(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    allowed = allowed_tokens(logits, temperature, top_k, top_p, min_p, tol=0.0)
    assert np.array_equal(allowed, allowed_tokens(logits, temperature, top_k, top_p, min_p, 1e-3))
    logits = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.where(allowed, np.exp(logits - logits.max()), 0.0)
    return probs / probs.sum()


def chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's test at p = 1e-3 (bins of expected count under 5 pooled); the critical
    value by Wilson and Hilferty's approximation."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    df = len(expected) - 1
    if df == 0:
        return True
    stat = float(((observed - expected) ** 2 / expected).sum())
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def random_settings(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 6, rows)  # greedy, temperature, top-k, top-p, min-p, all three
    temperature = np.where(kind == 0, 0.0, rng.uniform(0.3, 2.0, rows))
    top_k = np.where((kind == 2) | (kind == 5), rng.choice([1, 2, 5, 7, 8, 50, 500, 1999], rows), 0)
    top_p = np.where((kind == 3) | (kind == 5), rng.uniform(0.2, 0.99, rows), 1.0)
    min_p = np.where((kind == 4) | (kind == 5), rng.uniform(0.01, 0.5, rows), 0.0)
    return kind, make_metadata(temperature.tolist(), top_p.tolist(), top_k.tolist(), min_p.tolist())
