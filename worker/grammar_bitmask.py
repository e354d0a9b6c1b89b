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
    logits_rows: np.ndarray,
    drafts: dict[str, list[int]] | None = None,
) -> None:
    """Mask `logits` in place. Logits row i belongs to the request of batch row
    `logits_rows[i]` (a request verifying drafts has 1 + len(drafts) consecutive logits
    rows, and as many bitmask rows); the bitmask rows follow `request_ids` (a request that
    does not sample here, one the workers failed, is skipped)."""
    drafts = drafts or {}
    first_row: dict[str, int] = {}
    for i, row in enumerate(logits_rows.tolist()):
        first_row.setdefault(batch_req_ids[row], i)
    mask_rows, rows = [], []
    num_mask_rows = 0
    for request_id in request_ids:
        count = 1 + len(drafts.get(request_id, ()))
        first = first_row.get(request_id)
        if first is not None:
            mask_rows += range(num_mask_rows, num_mask_rows + count)
            rows += range(first, first + count)
        num_mask_rows += count
    if not rows:
        return
    words = np.frombuffer(bitmask, dtype="<i4").reshape(num_mask_rows, -1)
    device = logits.device
    allowed = unpack_bitmask(torch.from_numpy(words[mask_rows]).to(device), logits.shape[1])
    index = torch.tensor(rows, dtype=torch.long, device=device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [n, w] -> bool [n, vocab_size] (columns past 32 * w are False)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(words.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(words.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)
