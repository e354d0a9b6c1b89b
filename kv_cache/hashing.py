"""Chained block hashes: a block's hash names its tokens and every token before it.

hash(block i) = xxh3_128(hash(block i-1) | token count | token ids as int64 | extra keys),
with NONE_HASH standing in for the parent of block 0. Because the parent is folded in,
equal tokens after different prefixes hash differently, and a matching hash for block i
means the whole prefix up to and including block i matches. Only full blocks are hashed.
"""

import os
from collections.abc import Sequence

import numpy as np
import xxhash

_TOKEN_BYTES = 8


def _init_none_hash() -> bytes:
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return os.urandom(16)
    return xxhash.xxh3_128_digest(f"splitserve-none-hash:{seed}".encode())


NONE_HASH: bytes = _init_none_hash()


def _encode_key(key: object) -> bytes:
    """Self-delimiting encoding: type tag, 4-byte length, payload."""
    if isinstance(key, str):
        tag, payload = b"s", key.encode()
    elif isinstance(key, bytes):
        tag, payload = b"b", key
    elif isinstance(key, int):
        tag, payload = b"i", str(key).encode()
    elif isinstance(key, tuple):
        tag, payload = b"t", b"".join(_encode_key(k) for k in key)
    else:
        raise TypeError(f"unsupported extra key type {type(key).__name__}")
    return tag + len(payload).to_bytes(4, "little") + payload


def _hash(parent_hash: bytes | None, token_bytes: bytes, extra_keys: tuple | None) -> bytes:
    num_tokens = (len(token_bytes) // _TOKEN_BYTES).to_bytes(4, "little")
    extra = _encode_key(extra_keys) if extra_keys else b""
    return xxhash.xxh3_128_digest(
        b"".join((parent_hash or NONE_HASH, num_tokens, token_bytes, extra))
    )


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """Hash one block of tokens chained from its parent's hash (None for the first block)."""
    return _hash(parent_hash, np.asarray(token_ids, dtype=np.int64).tobytes(), extra_keys)


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> None:
    """Append to `hashes` the hashes of the blocks of `token_ids` (the whole sequence so far)
    that became full since the last call; blocks already hashed are not hashed again.
    The cache salt enters the extra keys of the first block only; chaining carries it on."""
    num_hashed = len(hashes)
    num_full = len(token_ids) // block_size
    if num_full <= num_hashed:
        return
    start = num_hashed * block_size
    data = np.asarray(token_ids[start : num_full * block_size], dtype=np.int64).tobytes()
    step = block_size * _TOKEN_BYTES
    parent = hashes[-1] if hashes else None
    for i in range(num_hashed, num_full):
        extra = (cache_salt,) if i == 0 and cache_salt else None
        offset = (i - num_hashed) * step
        parent = _hash(parent, data[offset : offset + step], extra)
        hashes.append(parent)


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, cache_salt)
    return hashes
