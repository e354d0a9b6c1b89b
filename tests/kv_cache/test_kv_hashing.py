import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_cache import NONE_HASH, block_hashes, extend_block_hashes, hash_block_tokens

REPO = Path(__file__).resolve().parents[2]


def test_hash_is_16_bytes_and_deterministic():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 16
    assert h == hash_block_tokens(None, (1, 2, 3, 4))
    assert h == hash_block_tokens(None, np.array([1, 2, 3, 4], dtype=np.int32))
    assert h == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert h != hash_block_tokens(None, [1, 2, 3, 5])
    assert h != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))


def test_only_full_blocks_are_hashed():
    assert block_hashes([1, 2, 3], 4) == []
    assert len(block_hashes(list(range(11)), 4)) == 2


def test_chaining():
    tokens = [1, 2, 3, 4, 5, 6]
    h0, h1, h2 = block_hashes(tokens, 2)
    assert h0 == hash_block_tokens(None, [1, 2])
    assert h1 == hash_block_tokens(h0, [3, 4])
    assert h2 == hash_block_tokens(h1, [5, 6])
    # The same block tokens after a different prefix hash differently.
    other = block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert other[1] != h1 and other[2] != h2
    assert hash_block_tokens(None, [3, 4]) != h1


def test_cache_salt_enters_first_block_only_and_propagates():
    tokens = list(range(8))
    plain = block_hashes(tokens, 4)
    salted = block_hashes(tokens, 4, cache_salt="alice")
    assert salted[0] == hash_block_tokens(None, tokens[:4], ("alice",))
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:])
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert block_hashes(tokens, 4, cache_salt="bob") != salted
    assert block_hashes(tokens, 4, cache_salt="alice") == salted


def test_encoding_is_unambiguous():
    # Token count and key lengths are framed, so shifting bytes between fields changes the hash.
    assert hash_block_tokens(None, [1, 2], (3,)) != hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], ((1, 2),)) != hash_block_tokens(None, [1], (1, 2))


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=5),
    block_size=st.integers(1, 8),
    salt=st.sampled_from([None, "s"]),
)
def test_incremental_extension_matches_full_hashing(tokens, cuts, block_size, salt):
    hashes: list[bytes] = []
    for cut in sorted(cuts) + [len(tokens)]:
        extend_block_hashes(hashes, tokens[:cut], block_size, salt)
    assert hashes == block_hashes(tokens, block_size, salt)


def _none_hash_in_subprocess(seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    code = "import kv_cache; print(kv_cache.NONE_HASH.hex())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_none_hash_is_random_unless_pythonhashseed_is_set():
    assert _none_hash_in_subprocess("7") == _none_hash_in_subprocess("7")
    assert _none_hash_in_subprocess("7") != _none_hash_in_subprocess("8")
    assert _none_hash_in_subprocess(None) != _none_hash_in_subprocess(None)
