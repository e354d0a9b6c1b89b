"""Every backend with an fp8 KV cache, through the real Attention layer (its store, with
the layer's scales, then attention over the pages), against the same steps over the 16-bit
cache: prefills, a chunk that reads an earlier chunk's pages, decodes. The Triton backend
and the Triton stores (plain and fused with rotary) run on the GPU when there is one, else
under the interpreter; the stores bit for bit against the torch store."""

import pytest
import torch
from paged_requests import PagedRequests

from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from attention.backends.triton_backend import DecodeLaunch, TritonAttentionBackend
from attention.rotation import RopeTables
from attention.store_kv import store_kv_torch
from attention.triton_rope_store import rotate_and_store_kv
from attention.triton_store_kv import store_kv_triton
from kernels import KernelSet

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
STEPS = [
    [(0, 0, 20), (1, 0, 9), (2, 0, 33)],
    [(0, 20, 1), (1, 9, 12), (2, 33, 1)],
    [(0, 21, 1), (2, 34, 1)],
]
# fp8 against 16-bit pages: a relative error of up to 1/16 (e4m3) or 1/8 (e5m2) per value.
TOLERANCE = {
    torch.float8_e4m3fn: dict(atol=0.1, rtol=0.1),
    torch.float8_e5m2: dict(atol=0.3, rtol=0.2),
}


@pytest.fixture(params=["torch", "cpu", "triton"])
def backend(request):
    if request.param == "cpu":
        return CPUAttentionBackend(load_cpu_attention(KernelSet(cpu=True)))
    if request.param == "triton":  # decodes split into partials (v_scale applied to each)
        return TritonAttentionBackend(prefill_block_q=16, block_n=16, decode=DecodeLaunch(4))
    return TorchAttentionBackend()


def run_steps(backend, device, cache_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Every step's outputs, with the cache in cache_dtype (None: the model's) and scales
    of 0.5 (K) and 2 (V). The model is bf16 (the C++ prefill's dtype), but float32 under the
    Triton interpreter (numpy has no bf16)."""
    dtype = torch.float32 if backend.name == "triton" and device == "cpu" else torch.bfloat16
    reqs = PagedRequests([22, 21, 35], 4, 2, 64, 16, num_blocks=64, dtype=dtype, device=device)
    if cache_dtype is not None:
        reqs.kv_cache = torch.zeros(reqs.kv_cache.shape, dtype=cache_dtype, device=device)
        reqs.layer.kv_cache = reqs.kv_cache
        reqs.layer.load_kv_scale("k", torch.tensor(0.5))
        reqs.layer.load_kv_scale("v", torch.tensor([1.0, 2.0]))  # per head: the largest
        assert (reqs.layer.spec.k_scale, reqs.layer.spec.v_scale) == (0.5, 2.0)
    return [torch.cat(reqs.run_step(backend, step)).float() for step in STEPS]


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_cache_agrees_with_the_16_bit_cache(backend, kernel_device, fp8):
    device = kernel_device if backend.name == "triton" else "cpu"
    reference = run_steps(backend, device, None)
    outs = run_steps(backend, device, fp8)
    for out, expected in zip(outs, reference, strict=True):
        torch.testing.assert_close(out, expected, **TOLERANCE[fp8])
    # Fresh prompts may attend to the step's own k/v; later steps read pages.
    for out, expected in zip(outs[1:], reference[1:], strict=True):
        assert (out - expected).abs().max() > 0, "the fp8 pages must be read"


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_equals_torch_store(kernel_device, fp8, dtype):
    gen = torch.Generator().manual_seed(5)
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 45, 3, 24, 4, 30
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping = torch.cat([slots, torch.full((3,), -1)])
    kv = (torch.randn(48, 2, num_kv_heads, head_dim, generator=gen) * 300).to(dtype)
    start = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(fp8)
    expected, actual = start.clone(), start.clone().to(kernel_device)
    store_kv_torch(kv[:, 0], kv[:, 1], expected, slot_mapping, 0.37, 3.0)
    kv = kv.to(kernel_device)
    store_kv_triton(kv[:, 0], kv[:, 1], actual, slot_mapping.to(kernel_device), 0.37, 3.0, tile=16)
    assert torch.equal(actual.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
def test_rotate_and_store_writes_fp8_pages_as_the_torch_store(kernel_device, fp8):
    """The fused kernel rotates q and k as the plain rotary kernel does (checked in
    test_rope_store_kv.py) and stores the rotated k and v as store_kv_torch would."""
    gen = torch.Generator().manual_seed(6)
    num_tokens, heads, kv_heads, head_dim, block_size, max_pos = 13, 4, 2, 16, 4, 64
    dtype = torch.bfloat16
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    angles = torch.randn(max_pos, head_dim // 2, generator=gen)
    slot_mapping = torch.randperm(10 * block_size, generator=gen)[:num_tokens]
    slot_mapping[3] = -1
    cache = torch.zeros(2, 10, block_size, kv_heads, head_dim, dtype=fp8)
    to = {"device": kernel_device}
    q_dev, k_dev, v_dev, cache_dev = q.to(**to), k.to(**to), v.to(**to), cache.clone().to(**to)
    tables = RopeTables(positions.to(**to), angles.cos().to(**to), angles.sin().to(**to), dtype)
    assert rotate_and_store_kv(
        q_dev, k_dev, v_dev, cache_dev, slot_mapping.to(**to), tables, 0.25, 4.0
    )
    store_kv_torch(k_dev.cpu(), v, cache, slot_mapping, 0.25, 4.0)  # k as the kernel rotated it
    assert torch.equal(cache_dev.cpu().view(torch.uint8), cache.view(torch.uint8))
    assert cache.view(torch.uint8).any()
