from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    """The step's metadata, set around a forward pass. attn_metadata None means a
    profiling/plain run: every layer attends causally over all tokens as one sequence
    and touches no KV cache."""

    attn_metadata: AttentionMetadata | None
    backend: object | None = None


_context = ForwardContext(attn_metadata=None)


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, backend: object | None = None
) -> Iterator[None]:
    global _context
    previous = _context
    _context = ForwardContext(attn_metadata, backend)
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    return _context
