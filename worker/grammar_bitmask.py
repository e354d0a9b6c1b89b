"""Structured output on the worker: the EngineCore's grammar bitmask applied to the logits
rows of the structured requests that sample this step, before any other processing.

The bitmask arrives as bytes: one row per request of `structured_output_request_ids`,
cdiv(vocab_size, 32) little-endian int32 words each, bit j of word w set when token
32 * w + j is allowed. The rows are unpacked to a boolean mask on the logits' device;
disallowed tokens (and any logits column past the bitmask) become -inf. A step without
structured requests builds nothing here.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor,
    request_ids: list[str],
    bitmask: bytes,
    batch_req_ids: list[str | None],
    sample_rows: np.ndarray,
) -> None:
    """Mask `logits` in place. Logits row i belongs to the request of batch row
    `sample_rows[i]`; bitmask row k to `request_ids[k]` (one that does not sample here, a
    request the workers failed, is skipped)."""
    logits_row_of = {batch_req_ids[row]: i for i, row in enumerate(sample_rows.tolist())}
    pairs = [(k, logits_row_of[r]) for k, r in enumerate(request_ids) if r in logits_row_of]
    if not pairs:
        return
    words = np.frombuffer(bitmask, dtype="<i4").reshape(len(request_ids), -1)
    mask_rows, logits_rows = (list(column) for column in zip(*pairs, strict=True))
    device = logits.device
    allowed = unpack_bitmask(torch.from_numpy(words[mask_rows]).to(device), logits.shape[1])
    rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [n, w] -> bool [n, vocab_size] (columns past 32 * w are False)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(words.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(words.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)
