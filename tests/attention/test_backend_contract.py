"""The backend contract: every backend is an AttentionBackend, the forward context is typed,
and what the torch backend shares between the layers of a pass lives in the pass's
metadata (no cache on the backend keyed on which metadata or layer it saw last)."""

import sys

import fake_flash_attn
import pytest
import torch
from paged_requests import PagedRequests

from attention import (
    Attention,
    AttentionBackend,
    ForwardContext,
    get_attn_backend,
    get_forward_context,
    set_forward_context,
)
from attention.backends.flash_attn_backend import FlashAttentionBackend
from attention.backends.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from attention.backends.triton_backend import TritonAttentionBackend


def test_every_backend_implements_the_contract(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)
    backends = [TorchAttentionBackend(), TritonAttentionBackend(), FlashAttentionBackend()]
    backends += [get_attn_backend("auto", device) for device in ("cpu", "cuda")]
    for backend in backends:
        assert isinstance(backend, AttentionBackend)
        assert backend.name in ("torch", "cpu", "triton", "flash_attn")
    assert [b.cudagraph_support for b in backends[:3]] == [False, True, True]
    with pytest.raises(TypeError, match="abstract"):
        AttentionBackend()


def test_forward_context_is_typed_and_scoped():
    reqs = PagedRequests([5, 3], 2, 1, 8, 4)
    backend = TorchAttentionBackend()
    md = backend.build_metadata(reqs.metadata([(0, 0, 5), (1, 2, 1)])[0])
    with pytest.raises(ValueError, match="go together"):
        ForwardContext([md], None)
    assert get_forward_context() == ForwardContext()
    with set_forward_context([md], backend) as ctx:
        assert get_forward_context() is ctx
        assert ctx.attn_metadata == [md] and ctx.backend is backend
        with set_forward_context(None):
            assert get_forward_context().attn_metadata is None
        assert get_forward_context() is ctx
    assert get_forward_context() == ForwardContext()


def test_torch_layouts_live_in_the_pass_metadata():
    """Layers with the same window share one decode layout per group and one mask per
    prefill; a new step's metadata starts empty, and prepare_replay empties a reused one."""
    reqs = PagedRequests([9, 6, 12], 2, 1, 8, 4, sliding_window=3)
    for req, start in ((0, 8), (1, 5), (2, 4)):
        reqs.cache_prefix(req, start)
    backend = TorchAttentionBackend()
    schedule = [(0, 8, 1), (1, 5, 1), (2, 4, 8)]
    md = backend.build_metadata(reqs.metadata(schedule)[0])
    assert isinstance(md, TorchAttentionMetadata)
    second = Attention(2, 8, 8**-0.5, 1, sliding_window=3)
    second.kv_cache = reqs.kv_cache
    full = Attention(2, 8, 8**-0.5, 1)
    full.kv_cache = reqs.kv_cache
    q, k, v = torch.randn(10, 16), torch.randn(10, 8), torch.randn(10, 8)
    with set_forward_context([md], backend):
        first_out = reqs.layer(q, k, v)
        assert set(md.decode_layouts) == {(0, 3)} and set(md.prefill_masks) == {(2, 3)}
        layout = md.decode_layouts[(0, 3)]
        torch.testing.assert_close(second(q, k, v), first_out)
        assert md.decode_layouts[(0, 3)] is layout
        full(q, k, v)
        assert set(md.decode_layouts) == {(0, 3), (0, None)}
        assert set(md.prefill_masks) == {(2, 3), (2, None)}
    assert not backend.build_metadata(reqs.metadata(schedule)[0]).decode_layouts
    backend.prepare_replay(md)
    assert not md.decode_layouts and not md.prefill_masks
