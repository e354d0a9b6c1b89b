"""`bad_words` to the token ids the workers ban (vLLM's semantics).

Each word is tokenized as it would start a text and with a leading space, as it takes
mid-text. The workers ban a single-token word's token always, and a longer word's last
token when the output so far ends with its other tokens.
"""

from __future__ import annotations

import msgspec

from ipc.sampling_params import SamplingParams
from ipc.tokenizer import TokenizerLike


def bad_words_token_ids(words: list[str], tokenizer: TokenizerLike) -> list[list[int]]:
    token_ids: list[list[int]] = []
    for word in words:
        word = word.lstrip()
        for text in (word, " " + word):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in token_ids:
                token_ids.append(ids)
    return token_ids


def with_bad_words_token_ids(
    params: SamplingParams, tokenizer: TokenizerLike | None
) -> SamplingParams:
    """`params` with its bad_words' token ids added to bad_words_token_ids."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; pass bad_words_token_ids or a tokenizer")
    token_ids = list(params.bad_words_token_ids)
    for ids in bad_words_token_ids(params.bad_words, tokenizer):
        if ids not in token_ids:
            token_ids.append(ids)
    return msgspec.structs.replace(params, bad_words_token_ids=token_ids)
