"""The forward context: the step's attention metadata and backend, set around a forward pass."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from attention.backends.base import AttentionBackend
from attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    """What the attention layers of one forward pass read: the metadata of each KV cache
    group (a layer reads `attn_metadata[layer.kv_cache_group]`; the groups differ only in
    block table and slot mapping). attn_metadata None means a profiling/plain run: every
    layer attends causally over all tokens as one sequence and touches no KV cache."""

    attn_metadata: Sequence[AttentionMetadata] | None = None
    backend: AttentionBackend | None = None

    def __post_init__(self) -> None:
        if (self.attn_metadata is None) != (self.backend is None):
            raise ValueError("attention metadata and its backend go together")


_context = ForwardContext()


@contextmanager
def set_forward_context(
    attn_metadata: Sequence[AttentionMetadata] | None, backend: AttentionBackend | None = None
) -> Iterator[ForwardContext]:
    global _context
    previous = _context
    _context = ForwardContext(attn_metadata, backend)
    try:
        yield _context
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    return _context
