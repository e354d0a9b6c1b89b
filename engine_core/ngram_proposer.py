"""Prompt-lookup drafts: the tokens that followed the last occurrence of a request's
current suffix, found among its own tokens (prompt and output)."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to `k` draft tokens for a request from its tokens so far.

    The suffix is matched at the longest length n in [min_n, max_n] that occurs earlier
    in the sequence; among the occurrences of that length the latest wins (a repeated
    passage is more likely to continue as it did most recently). The drafts are the
    tokens after that occurrence, at most k and never past the end of the sequence.

    Each request's tokens are mirrored in a growing numpy array, so a step costs one
    vectorised comparison over the sequence plus work on the few candidate positions.
    """

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, request_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        """At most min(k, max_drafts) drafts for the request whose tokens are `token_ids`."""
        limit = min(self.k, max_drafts)
        if limit <= 0:
            return []
        tokens = self._mirror(request_id, token_ids)
        num_tokens = len(tokens)
        if num_tokens <= self.min_n:
            return []
        # Candidate ends: positions e < num_tokens - 1 holding the last token; a match of
        # length n ends at e when tokens[e - n + 1 : e + 1] equal the suffix of length n.
        last = tokens[-1]
        ends = np.flatnonzero(tokens[self.min_n - 1 : num_tokens - 1] == last) + self.min_n - 1
        if len(ends) == 0:
            return []
        length = 1
        matched = ends
        best_length, best = 0, -1
        while True:
            if length >= self.min_n and len(matched):
                best_length, best = length, int(matched[-1])
            if length == self.max_n or len(matched) == 0:
                break
            matched = matched[matched >= length]
            matched = matched[tokens[matched - length] == tokens[num_tokens - 1 - length]]
            length += 1
        if best_length == 0:
            return []
        return tokens[best + 1 : best + 1 + limit].tolist()

    def _mirror(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        """The request's tokens as an array view, appending only what is new since the
        last call (a preempted request keeps its tokens: they only grow)."""
        array, length = self._tokens.get(request_id, (None, 0))
        num_tokens = len(token_ids)
        if array is None or num_tokens > len(array) or num_tokens < length:
            grown = np.empty(max(2 * num_tokens, 64), dtype=np.int64)
            grown[:num_tokens] = token_ids
            array, length = grown, num_tokens
        elif num_tokens > length:
            array[length:num_tokens] = token_ids[length:]
            length = num_tokens
        self._tokens[request_id] = (array, length)
        return array[:length]

    def free(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
