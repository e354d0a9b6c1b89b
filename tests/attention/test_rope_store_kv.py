"""The fused rotary + store-KV kernel (attention/triton_rope_store.py; on the GPU, or under
TRITON_INTERPRET=1 without one) against the torch code it replaces: `apply_rotary`, then the
torch store. And the attention layer's choice, made by its backend: the fused kernel for
CUDA caches where it takes the tensors (and the kernel set has Triton on), rotation then
store everywhere else.

Tolerances are a few units of the dtype's rounding, as for the rotary kernel of
models/layers (tests/models/test_triton_ops.py); v and the slots nobody writes must match
exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attention import Attention, RopeTables, set_forward_context
from attention.backends.triton_store import TritonStoreBackend
from attention.store_kv import store_kv_torch
from attention.triton_rope_store import rotate_and_store_kv
from kernels import KernelSet
from models.layers.rotary import RotaryEmbedding, Rotator, apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAS_CUDA = torch.cuda.is_available()
MAX_POSITION = 100
NUM_BLOCKS = 6


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within 4 units of rounding of expected's dtype (values up to about 4). In
    float16, which the GPU and the interpreter both round to nearest, almost every element
    must agree exactly: that pins down where the kernel rounds."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.cpu(), expected.cpu()
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual, expected, rtol=4 * eps, atol=16 * eps)
    if expected.dtype == torch.float16:
        differ = (actual != expected).float().mean().item()
        assert differ < 0.02, f"{differ:.1%} of the elements differ"


def make_rope(head_dim: int, device: str) -> RotaryEmbedding:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return RotaryEmbedding(head_dim, MAX_POSITION, inv_freq).to(device)


class Step:
    """One step's q, k, v (strided views into fused qkv rows, as from a QKV projection),
    positions out of order, distinct random slots with the last `num_padding` -1, and a
    cache of random values, all on `device`."""

    def __init__(
        self,
        device: str,
        dtype: torch.dtype,
        num_tokens: int,
        heads: tuple[int, int],
        head_dim: int,
        block_size: int,
        num_padding: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(num_tokens * head_dim + block_size + heads[0])
        self.num_heads, self.num_kv_heads = heads
        self.head_dim, self.dtype = head_dim, dtype
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
        self.q, self.k, self.v = qkv.to(device).split([q_size, kv_size, kv_size], dim=-1)
        positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
        slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
        slots[num_tokens - num_padding :] = -1
        self.positions, self.slot_mapping = positions.to(device), slots.to(device)
        shape = (2, NUM_BLOCKS, block_size, self.num_kv_heads, head_dim)
        self.cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.rope = make_rope(head_dim, device)
        self.cpu_rope = make_rope(head_dim, "cpu")  # the same tables, for the reference

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.q.shape[0]
        return (
            self.q.view(n, self.num_heads, self.head_dim),
            self.k.view(n, self.num_kv_heads, self.head_dim),
            self.v.view(n, self.num_kv_heads, self.head_dim),
        )

    def tables(self) -> RopeTables:
        return RopeTables(self.positions, self.rope.cos_cache, self.rope.sin_cache, self.dtype)

    def expected(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, cache) after the torch code, on the CPU."""
        cos, sin = self.cpu_rope.get_cos_sin(self.positions.cpu(), self.dtype)
        q = apply_rotary(self.q.cpu(), cos, sin, self.head_dim)
        k = apply_rotary(self.k.cpu(), cos, sin, self.head_dim)
        cache = self.cache.cpu().clone()
        n = q.shape[0]
        shape = (n, self.num_kv_heads, self.head_dim)
        store_kv_torch(k.view(shape), self.v.cpu().view(shape), cache, self.slot_mapping.cpu())
        return q, k, cache

    def check(self, expected: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cache_before):
        """q, k and the cache (on their device) match the torch code's; v and the slots
        nobody wrote are unchanged, bit for bit."""
        expected_q, expected_k, expected_cache = expected
        assert_close(self.q, expected_q)
        assert_close(self.k, expected_k)
        assert_close(self.cache, expected_cache)
        flat = self.cache.cpu().flatten(1, 2)
        slot_mapping = self.slot_mapping.cpu()
        written = slot_mapping[slot_mapping >= 0]
        shape = (self.q.shape[0], self.num_kv_heads, self.head_dim)
        assert torch.equal(flat[1, written], self.v.cpu().view(shape)[slot_mapping >= 0])
        untouched = torch.ones(flat.shape[1], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(flat[:, untouched], cache_before.flatten(1, 2)[:, untouched])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "head_dim, heads, block_size, num_tokens, num_padding",
    [
        (64, (9, 3), 16, 37, 5),
        (128, (4, 4), 32, 37, 0),
        (80, (9, 3), 32, 1, 0),  # head_dim not a power of 2
        (64, (4, 4), 32, 1, 0),
        (128, (9, 3), 16, 1, 1),  # one token, padding
        (80, (4, 4), 16, 37, 3),
        (64, (4, 4), 16, 5, 5),  # all padding (a CUDA graph's warm-up): nothing stored
    ],
)
def test_fused_kernel_equals_rotary_then_store(
    kernel_device, dtype, head_dim, heads, block_size, num_tokens, num_padding
):
    step = Step(kernel_device, dtype, num_tokens, heads, head_dim, block_size, num_padding)
    expected, cache_before = step.expected(), step.cache.cpu().clone()
    tables = step.tables()
    assert rotate_and_store_kv(*step.views(), step.cache, step.slot_mapping, tables)
    step.check(expected, cache_before)


def test_shapes_the_fused_kernel_does_not_take():
    """It declines them, touching nothing; the last call takes its tensors."""
    step = Step("cpu", torch.bfloat16, 4, (4, 2), 64, 16)
    q, k, v = step.views()
    tables, cache, slots = step.tables(), step.cache, step.slot_mapping
    before = [t.clone() for t in (q, k, v, cache)]
    assert not rotate_and_store_kv(q, k, v, cache.float(), slots, tables)  # the cache's dtype
    as_float = RopeTables(tables.positions, tables.cos_cache, tables.sin_cache, torch.float32)
    assert not rotate_and_store_kv(q, k, v, cache, slots, as_float)  # the rotation's dtype
    wider = make_rope(128, "cpu")
    wider_tables = RopeTables(tables.positions, wider.cos_cache, wider.sin_cache, q.dtype)
    assert not rotate_and_store_kv(q, k, v, cache, slots, wider_tables)  # the head_dim
    as_double = [t.double() for t in (q, k, v, cache)]
    double_tables = RopeTables(tables.positions, tables.cos_cache, tables.sin_cache, torch.float64)
    assert not rotate_and_store_kv(*as_double, slots, double_tables)
    strided_q = torch.randn(4, 4, 128, dtype=q.dtype)[..., ::2]
    assert not rotate_and_store_kv(strided_q, k, v, cache, slots, tables)
    assert not rotate_and_store_kv(q, k, v, cache[:, :, :, :1], slots, tables)  # kv heads
    assert not rotate_and_store_kv(q, k, v, cache, slots[:3], tables)
    fewer_positions = RopeTables(tables.positions[:3], tables.cos_cache, tables.sin_cache, q.dtype)
    assert not rotate_and_store_kv(q, k, v, cache, slots, fewer_positions)
    assert all(torch.equal(t, b) for t, b in zip((q, k, v, cache), before, strict=True))
    assert rotate_and_store_kv(q, k, v, cache, slots, tables)


class RecordingBackend(TritonStoreBackend):
    """Attention that answers q and keeps (clones of) the q, k and v it was handed, and the
    names of the stores it ran (`stores`)."""

    name = "recording"

    def __init__(self, triton_store: bool = True) -> None:
        super().__init__(triton_store)
        self.stores: list[str] = []

    def store_kv(self, *args) -> None:
        self.stores.append("store_kv")
        super().store_kv(*args)

    def rotate_and_store_kv(self, *args) -> bool:
        fused = super().rotate_and_store_kv(*args)
        if fused:
            self.stores.append("rotate_and_store_kv")
        return fused

    def attend(self, spec, q, k, v, kv_cache, md, out) -> None:
        self.seen = (q.clone(), k.clone(), v.clone())
        out[: md.num_actual_tokens] = q[: md.num_actual_tokens]


def run_layer(step: Step, rotate: Rotator, backend: RecordingBackend) -> None:
    """One step of an Attention layer with a cache over `step`, checked against the torch
    code: the output, what the backend was handed, the cache."""
    expected, cache_before = step.expected(), step.cache.cpu().clone()
    layer = Attention(step.num_heads, step.head_dim, step.head_dim**-0.5, step.num_kv_heads)
    layer.kv_cache = step.cache
    num_tokens = step.q.shape[0]
    md = SimpleNamespace(slot_mapping=step.slot_mapping, num_actual_tokens=num_tokens)
    q, k, v = step.q.clone(), step.k.clone(), step.v.clone()
    with set_forward_context([md], backend):
        out = layer(q, k, v, rotate=rotate)
    seen_q, seen_k, seen_v = (t.reshape(num_tokens, -1) for t in backend.seen)
    assert_close(out, expected[0])
    assert_close(seen_q, expected[0])
    assert_close(seen_k, expected[1])
    assert torch.equal(seen_v, step.v)
    step.q, step.k = seen_q, seen_k
    step.check(expected, cache_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_rotates_then_stores_a_cpu_cache(dtype):
    """Even a rotation that offers its tables: the fused kernel is for CUDA caches."""
    step = Step("cpu", dtype, 9, (4, 2), 64, 16, num_padding=2)
    rotator = step.rope.rotator(step.positions, dtype)
    assert rotator.rope_tables is None
    backend = RecordingBackend()
    run_layer(step, Rotator(rotator.apply, step.tables()), backend)
    assert backend.stores == ["store_kv"]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_fuses_rotary_and_store_for_a_cuda_cache(dtype):
    step = Step("cuda", dtype, 9, (4, 2), 64, 16, num_padding=2)
    step.rope.bind_kernels(KernelSet.for_device("cuda", environ={}))
    rotator = step.rope.rotator(step.positions, dtype)
    assert rotator.rope_tables is not None
    backend = RecordingBackend()
    run_layer(step, rotator, backend)
    assert backend.stores == ["rotate_and_store_kv"]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_switch_sends_a_cuda_layer_down_rotation_then_store():
    """SPLITSERVE_TRITON_KERNELS=0: the rotation offers no tables, and the backend would not
    fuse (nor store with Triton) if it did."""
    kernels = KernelSet.for_device("cuda", environ={"SPLITSERVE_TRITON_KERNELS": "0"})
    step = Step("cuda", torch.bfloat16, 9, (4, 2), 64, 16, num_padding=2)
    step.rope.bind_kernels(kernels)
    rotator = step.rope.rotator(step.positions, torch.bfloat16)
    assert rotator.rope_tables is None
    backend = RecordingBackend(kernels.triton)
    run_layer(step, Rotator(rotator.apply, step.tables()), backend)
    assert backend.stores == ["store_kv"]


def test_layer_without_metadata_rotates_and_attends_causally():
    """The profiling run: no cache is touched, and rotating in the layer is rotating first."""
    step = Step("cpu", torch.float32, 7, (4, 2), 64, 16)
    layer = Attention(4, 64, 64**-0.5, 2)
    expected_q, expected_k, _ = step.expected()
    rotate = step.rope.rotator(step.positions, torch.float32)
    out = layer(step.q.clone(), step.k.clone(), step.v, rotate=rotate)
    assert_close(out, layer(expected_q, expected_k, step.v))
