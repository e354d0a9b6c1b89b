"""The store-KV kernels against the torch store, exactly: the Triton kernel (on the GPU, or
under TRITON_INTERPRET=1 without one) and the CPU backend's C++ row copy. And the store each
backend runs, as the kernel set says."""

import pytest
import torch

from attention import get_attn_backend
from attention.backends import triton_store
from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from attention.backends.triton_backend import TritonAttentionBackend
from attention.store_kv import store_kv_torch
from attention.triton_store_kv import store_kv_triton
from kernels import KernelSet


@pytest.fixture(scope="module")
def cpu_attention():
    module = load_cpu_attention(KernelSet(cpu=True))
    assert module is not None, "the C++ kernels must build wherever tests run"
    return module


def stored_both_ways(
    device, num_tokens, num_padding, num_kv_heads, head_dim, block_size, num_blocks
):
    gen = torch.Generator().manual_seed(num_tokens)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping = torch.cat([slots, torch.full((num_padding,), -1)])
    # k/v as strided views of one projection, with rows past the slot mapping
    total = num_tokens + num_padding + 3
    kv = torch.randn(total, 3, num_kv_heads, head_dim, generator=gen)
    k, v = kv[:, 0], kv[:, 2]
    expected, actual = cache.clone(), cache.clone().to(device)
    store_kv_torch(k, v, expected, slot_mapping)
    kv_on_device = kv.to(device)
    k_on_device, v_on_device = kv_on_device[:, 0], kv_on_device[:, 2]
    store_kv_triton(k_on_device, v_on_device, actual, slot_mapping.to(device), tile=16)
    return cache, expected, actual.cpu(), slots, k, v


@pytest.mark.parametrize(
    "num_tokens, num_padding, num_kv_heads, head_dim, block_size, num_blocks",
    [
        (1, 0, 1, 4, 16, 4),
        (37, 5, 2, 8, 4, 64),
        (300, 13, 3, 6, 16, 40),  # head_dim not a power of 2; many tiles
        (50, 0, 1, 4, 2, 60000),  # large block ids
    ],
)
def test_triton_store_kv_equals_torch(
    kernel_device, num_tokens, num_padding, num_kv_heads, head_dim, block_size, num_blocks
):
    cache, expected, actual, slots, k, v = stored_both_ways(
        kernel_device, num_tokens, num_padding, num_kv_heads, head_dim, block_size, num_blocks
    )
    assert torch.equal(actual, expected)
    flat = expected.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, slots], k[:num_tokens])
    assert torch.equal(flat[1, slots], v[:num_tokens])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], cache.view_as(flat)[:, untouched])


@pytest.mark.parametrize("path", ["c++", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, num_padding", [(1, 0), (37, 5), (60, 4), (1500, 20)])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_store_kv_writes_each_row_at_its_slot(
    cpu_attention, path, dtype, num_tokens, num_padding, threads
):
    """The C++ store (cpu_attn.cpp) and the torch store against a row-by-row copy: every
    slot gets its token's K and V rows, padding (-1) and every other slot are untouched.
    At 2 threads, a decode step's rows are split by K and V halves (64 rows here)."""
    torch.set_num_threads(threads)
    backend = CPUAttentionBackend(cpu_attention) if path == "c++" else TorchAttentionBackend()
    gen = torch.Generator().manual_seed(num_tokens)
    num_kv_heads, head_dim, block_size, num_blocks = 3, 64, 16, 200
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping = torch.cat([slots, torch.full((num_padding,), -1)])
    slot_mapping = slot_mapping[torch.randperm(len(slot_mapping), generator=gen)]
    qkv = torch.randn(len(slot_mapping) + 2, 5, num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = qkv[:, 3], qkv[:, 4]  # strided rows, as views of one projection
    expected = cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[:, slot // block_size, slot % block_size] = torch.stack([k[t], v[t]])
    backend.store_kv(k, v, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_cpu_store_kv_declines_rows_that_are_not_dense(cpu_attention):
    """The kernel says it does not take them, writing nothing; the backend stores them with
    torch ops."""
    cache, slot_mapping = torch.zeros(2, 4, 16, 2, 8), torch.tensor([5, -1, 17])
    k, v = torch.randn(3, 8, 2).transpose(1, 2), torch.randn(3, 2, 8)  # k: heads strided
    assert not cpu_attention.store_kv(k, v, cache, slot_mapping)
    assert not cache.any()
    expected = cache.clone()
    store_kv_torch(k, v, expected, slot_mapping)
    CPUAttentionBackend(cpu_attention).store_kv(k, v, cache, slot_mapping)
    assert torch.equal(cache, expected) and cache.any()


def test_cpu_store_kv_refuses_a_slot_outside_the_cache(cpu_attention):
    cache = torch.zeros(2, 4, 16, 1, 8)
    k = v = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.store_kv(k, v, cache, torch.tensor([3, 64]))
    assert not cache.any()


@pytest.fixture
def triton_stores(monkeypatch) -> list[str]:
    """The devices of the caches the Triton store kernel writes (it still runs)."""
    calls: list[str] = []

    def spy(k, v, kv_cache, slot_mapping, *scales):
        calls.append(kv_cache.device.type)
        return store_kv_triton(k, v, kv_cache, slot_mapping, *scales)

    monkeypatch.setattr(triton_store, "store_kv_triton", spy)
    return calls


@pytest.mark.parametrize("triton", [True, False])
def test_cuda_backends_store_with_triton_where_the_kernel_set_has_it(
    kernel_device, triton_stores, triton
):
    """SPLITSERVE_TRITON_KERNELS=0 (a KernelSet without Triton) reaches the CUDA store;
    CPU caches (the Triton backend under the interpreter) are stored with torch ops."""
    backend = get_attn_backend("triton", "cuda", kernels=KernelSet(triton=triton))
    assert isinstance(backend, TritonAttentionBackend) and backend.triton_store == triton
    assert backend.cudagraph_support == triton  # the torch store syncs: no capture
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 8, 4, 2, 8, generator=gen)
    slot_mapping = torch.cat([torch.randperm(32, generator=gen)[:9], torch.full((2,), -1)])
    k, v = torch.randn(11, 2, 8, generator=gen), torch.randn(11, 2, 8, generator=gen)
    expected, on_device = cache.clone(), cache.to(kernel_device)
    store_kv_torch(k, v, expected, slot_mapping)
    to = {"device": kernel_device}
    backend.store_kv(k.to(**to), v.to(**to), on_device, slot_mapping.to(**to))
    assert torch.equal(on_device.cpu(), expected)
    assert triton_stores == (["cuda"] if kernel_device == "cuda" and triton else [])
