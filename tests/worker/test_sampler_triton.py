"""The Triton sampling kernel (on the GPU, or under TRITON_INTERPRET=1 without one) against
the torch path and the C++ kernel on the same uniform draws, and its frequencies against the
exact filtered distribution."""

import dataclasses

import numpy as np
import pytest
import torch

from kernels import KernelSet
from tests.worker.sampler_helpers import (
    CASES,
    LOGITS,
    chi_square_ok,
    exact_probs,
    make_metadata,
    masked_batch,
    metadata_of,
    random_settings,
)
from worker import sampler as sampler_module
from worker.sampler import (
    SAMPLING_EPS,
    Sampler,
    SamplingMetadata,
    _draw_uniforms,
    cpu_sampling_kernel,
)
from worker.sampler_triton import sample_triton


def on_device(metadata: SamplingMetadata, device: str) -> SamplingMetadata:
    moved = {
        name: getattr(metadata, name).to(device)
        for name in ("temperature", "top_k", "top_p", "min_p")
        if getattr(metadata, name) is not None
    }
    return dataclasses.replace(metadata, **moved)


def uniforms(metadata: SamplingMetadata, rows: int, seed: int, device: str) -> torch.Tensor:
    """The draws the torch path makes with a default generator seeded `seed`."""
    generator = torch.Generator(device).manual_seed(seed)
    return _draw_uniforms(rows, metadata.generators, generator, torch.device(device))


def triton_tokens(logits, metadata, seed, tile=2048, cpu_draws=False) -> torch.Tensor:
    """The kernel's tokens; with cpu_draws, on the draws the torch path makes for CPU
    logits (a CUDA generator draws other numbers from the same seed)."""
    m = metadata
    u = uniforms(m, logits.shape[0], seed, "cpu" if cpu_draws else logits.device.type)
    u = u.to(logits.device)
    return sample_triton(logits, m.temperature, m.top_k, m.top_p, m.min_p, u, SAMPLING_EPS, tile)


def torch_tokens(logits, metadata, seed) -> torch.Tensor:
    generator = torch.Generator(logits.device.type).manual_seed(seed)
    reference = Sampler(generator, KernelSet())
    return reference(logits, metadata).sampled_token_ids


def cpp_tokens(logits, metadata, seed) -> torch.Tensor | None:
    """The C++ kernel's tokens for CPU logits, None where the logits are not."""
    if logits.device.type != "cpu":
        return None
    kernels = cpu_sampling_kernel(KernelSet(cpu=True))
    assert kernels is not None, "the C++ sampling kernel did not build"
    m = metadata
    u = uniforms(m, logits.shape[0], seed, "cpu")
    return kernels.sample(logits.float(), m.temperature, m.top_k, m.top_p, m.min_p, u, SAMPLING_EPS)


# Under the Triton interpreter (no GPU) the large cases took ~40 s of the default set:
# slow there (make test-all runs them), in the default set on CUDA.
INTERPRETED = () if torch.cuda.is_available() else pytest.mark.slow


@pytest.mark.parametrize(
    "vocab, tile, dtype",
    [
        (50, 16, torch.float32),
        (50, 2048, torch.bfloat16),
        (1000, 128, torch.float32),
        pytest.param(1000, 128, torch.bfloat16, marks=INTERPRETED),
        pytest.param(4099, 2048, torch.float32, marks=INTERPRETED),
        pytest.param(4099, 2048, torch.bfloat16, marks=INTERPRETED),
        pytest.param(4099, 1024, torch.float16, marks=INTERPRETED),
    ],
)
def test_same_tokens_as_the_torch_path_and_the_cpp_kernel(kernel_device, dtype, vocab, tile):
    """Greedy, temperature, top-k, top-p, min-p and all three, on the same draws. In half
    precision top-p's boundary can fall in a run of equal logits, which the kernels keep
    whole and the torch path in part: those rows are compared with the C++ kernel only."""
    rows = 24
    generator = torch.Generator().manual_seed(vocab + tile)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    kind, metadata = random_settings(rows, seed=vocab)
    fast = triton_tokens(
        logits.to(kernel_device), on_device(metadata, kernel_device), 3, tile, cpu_draws=True
    )
    fast = fast.cpu()
    greedy = torch.from_numpy(kind == 0)
    assert torch.equal(fast[greedy], logits[greedy].float().argmax(-1))
    compared = torch.ones(rows, dtype=torch.bool)
    if dtype != torch.float32:
        compared = torch.from_numpy(~np.isin(kind, [3, 5]))
    assert torch.equal(fast[compared], torch_tokens(logits, metadata, 3)[compared])
    cpp = cpp_tokens(logits, metadata, 3)
    if cpp is not None:
        assert torch.equal(fast, cpp)


def test_top_k_keeps_every_logit_tied_with_the_kth(kernel_device):
    rows, vocab = 16, 600
    generator = torch.Generator().manual_seed(8)
    logits = torch.randint(-20, 20, (rows, vocab), generator=generator).float()
    metadata = make_metadata([1.0] * rows, top_k=[1, 3, 40, 599] * (rows // 4))
    fast = triton_tokens(
        logits.to(kernel_device), on_device(metadata, kernel_device), 9, 128, cpu_draws=True
    )
    fast = fast.cpu()
    assert torch.equal(fast, torch_tokens(logits, metadata, 9))
    kth = logits.sort(dim=-1, descending=True).values[torch.arange(rows), metadata.top_k - 1]
    assert (logits[torch.arange(rows), fast] >= kth).all()
    assert (logits[0::4].gather(1, fast[0::4, None]).squeeze(1) == logits[0::4].amax(-1)).all()


@pytest.mark.parametrize("interpreted", [pytest.param(True, marks=INTERPRETED)], ids=[""])
def test_frequencies_fit_the_exact_distribution(kernel_device, interpreted):
    """Three of the C++ kernel's cases (temperature alone, top-k + top-p + min-p, top-p +
    min-p) in one launch: the interpreter samples about a hundred rows a second."""
    cases = [CASES[1], CASES[9], CASES[11]]
    per_case = 160
    settings = [case for case in cases for _ in range(per_case)]
    metadata = metadata_of(settings)
    logits = torch.tensor(LOGITS).expand(len(settings), len(LOGITS)).contiguous()
    sampled = triton_tokens(logits.to(kernel_device), on_device(metadata, kernel_device), 21)
    sampled = sampled.cpu().numpy().reshape(len(cases), per_case)
    for case, tokens in zip(cases, sampled, strict=True):
        probs = exact_probs(LOGITS, *case)
        counts = np.bincount(tokens, minlength=len(LOGITS))
        assert counts[probs == 0].sum() == 0, case
        assert chi_square_ok(counts, probs), (case, counts, np.round(probs * per_case))


def test_seeded_rows_are_deterministic_and_independent_of_the_batch(kernel_device):
    vocab, seed = 300, 11
    generator = torch.Generator().manual_seed(12)
    row = torch.randn(vocab, generator=generator).to(kernel_device)

    def seeded_generator() -> torch.Generator:
        return torch.Generator(kernel_device).manual_seed(seed)

    alone = make_metadata([0.9], [0.95], generators={0: seeded_generator()})
    alone = on_device(alone, kernel_device)
    tokens = [int(triton_tokens(row[None], alone, 0)[0]) for _ in range(6)]
    assert len(set(tokens)) > 1  # the generator advances: a different draw each step
    batch = make_metadata(
        [1.0, 0.0, 0.9, 0.7],
        top_p=[1.0, 1.0, 0.95, 0.5],
        top_k=[5, 0, 0, 3],
        generators={2: seeded_generator(), 3: torch.Generator(kernel_device).manual_seed(13)},
    )
    batch = on_device(batch, kernel_device)
    for step, token in enumerate(tokens):
        others = torch.randn(3, vocab, generator=generator).to(kernel_device)
        rows = torch.cat([others[:2], row[None], others[2:]])
        assert int(triton_tokens(rows, batch, step)[2]) == token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_tokens_are_never_sampled(kernel_device, dtype):
    """-inf logits have no mass in any filter; a row with one finite logit samples it, and a
    row of -inf takes token 0 (torch.argmax's)."""
    rows, vocab = 24, 700
    odd = torch.arange(1, rows - 1, 2)
    logits, keep, metadata = masked_batch(rows, vocab, 0.02, odd)
    keep[-1] = False
    logits[-1] = float("-inf")
    metadata = on_device(metadata, kernel_device)
    sampled = triton_tokens(logits.to(dtype).to(kernel_device), metadata, 15, 256).cpu()
    assert keep[torch.arange(rows - 1), sampled[:-1]].all()
    assert torch.equal(sampled[odd], odd * 7)
    assert sampled[-1] == 0


def test_sampler_dispatches_only_cuda_logits_to_triton(kernel_device, monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].device.type)
        return sample_triton(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "sample_triton", spy)
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(16)).to(kernel_device)
    metadata = on_device(make_metadata([0.0, 1.0, 0.7, 1.2], top_k=[0, 5, 0, 20]), kernel_device)
    for cpu in (True, False):
        sampler = Sampler(kernels=KernelSet(cpu=cpu, triton=True))
        sampled = sampler(logits, metadata).sampled_token_ids
        assert sampled.device.type == kernel_device and sampled[0] == logits[0].argmax()
    assert calls == (["cuda", "cuda"] if kernel_device == "cuda" else [])
    Sampler(kernels=KernelSet(cpu=True))(logits, metadata)
    assert len(calls) == (2 if kernel_device == "cuda" else 0)
