"""The environment is read once, into the KernelSet: a forward pass, the attention of a step
and a sampling step read no SPLITSERVE_* variable (they used to, on every kernel call)."""

import os

import torch

from attention import get_attn_backend
from kernels import KernelSet
from models import load_model
from tests.attention.paged_requests import PagedRequests
from tests.models.tiny import make_tiny_checkpoint
from worker.sampler import Sampler, SamplingMetadata


class RecordingEnviron(dict):
    """os.environ's values, recording the names looked up."""

    def __init__(self, values) -> None:
        super().__init__(values)
        self.read: list[str] = []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.read.append(key)
        return super().__contains__(key)


@torch.no_grad()
def test_kernels_read_no_environment_once_chosen(monkeypatch, tmp_path):
    kernels = KernelSet.for_device("cpu")
    model = load_model(make_tiny_checkpoint(tmp_path, "llama"), torch.bfloat16, kernels=kernels)
    backend = get_attn_backend("auto", "cpu", kernels=kernels)
    sampler = Sampler(torch.Generator().manual_seed(0), kernels)
    reqs = PagedRequests([20, 5], 4, 2, 64, 16, dtype=torch.bfloat16)
    reqs.cache_prefix(0, 19)
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.0, 0.8]),
        top_p=None,
        top_k=torch.tensor([0, 5], dtype=torch.int32),
        min_p=None,
        all_greedy=False,
        all_random=False,
        generators={},
        max_num_logprobs=None,
    )
    environ = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    hidden = model(torch.randint(0, 288, (9,)), torch.arange(9))
    reqs.run_step(backend, [(0, 19, 1), (1, 0, 5)])
    sampler(model.compute_logits(hidden[-2:]), metadata)
    read = [key for key in environ.read if isinstance(key, str) and key.startswith("SPLITSERVE")]
    assert read == []
