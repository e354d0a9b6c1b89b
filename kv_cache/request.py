"""What the KV cache reads from a request (duck-typed; the engine's Request satisfies it)."""

from typing import Protocol


class KVCacheRequest(Protocol):
    """`block_hashes` are the chained hashes of the request's full blocks, grown as tokens
    arrive (see extend_block_hashes); nothing else of the request is read."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> list[bytes]: ...
