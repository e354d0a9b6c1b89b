"""Prompt logprobs: for the rows that ask for them, the logprob of each prompt token that
this step's tokens predict (the hidden state at position p predicts token p + 1), its
rank in the vocabulary, and the top-k at its position. A chunk of a prompt gives the
positions it computes; a step where no row asks builds nothing.

The logits of a long prompt are [num_positions, vocab] float32, so they are made and
reduced a slice of positions at a time (LOGITS_BYTES each)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import PromptLogprobs, TokenLogprobs
from worker.input_batch import InputBatch

LOGITS_BYTES = 64 << 20


@dataclass
class PromptLogprobsPlan:
    """Which hidden states give which prompt tokens' logprobs this step. Request i owns
    entries `offsets[i]:offsets[i + 1]`, of prompt tokens starts[i], starts[i] + 1, ..."""

    req_ids: list[str]
    num_logprobs: list[int]
    starts: list[int]
    offsets: list[int]
    hidden_indices: np.ndarray
    target_ids: np.ndarray


def plan_prompt_logprobs(
    batch: InputBatch, query_start_loc: np.ndarray, seq_lens: np.ndarray
) -> PromptLogprobsPlan | None:
    """`query_start_loc` and `seq_lens`: this step's, per batch row (seq_lens[row] is the
    row's computed tokens after the step)."""
    req_ids, num_logprobs, starts, offsets = [], [], [], [0]
    hidden_indices, target_ids = [], []
    for row, k in sorted(batch.num_prompt_logprobs.items()):
        first = int(batch.num_computed_tokens[row])
        end = min(int(seq_lens[row]), int(batch.num_prompt_tokens[row]) - 1)
        if end <= first:
            continue
        req_ids.append(batch.req_ids[row])
        num_logprobs.append(k)
        starts.append(first + 1)
        offsets.append(offsets[-1] + end - first)
        hidden_indices.append(np.arange(end - first) + query_start_loc[row])
        target_ids.append(batch.token_ids[row, first + 1 : end + 1])
    if not req_ids:
        return None
    return PromptLogprobsPlan(
        req_ids,
        num_logprobs,
        starts,
        offsets,
        np.concatenate(hidden_indices).astype(np.int64),
        np.concatenate(target_ids).astype(np.int64),
    )


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    plan: PromptLogprobsPlan,
    vocab_size: int,
    is_driver: bool,
) -> dict[str, PromptLogprobs]:
    """Every rank computes the logits (they are gathered across tensor-parallel ranks);
    the driver reduces them and returns request id -> its prompt logprobs this step."""
    device = hidden.device
    indices = torch.from_numpy(plan.hidden_indices).to(device)
    targets = torch.from_numpy(plan.target_ids).to(device).unsqueeze(1)
    k = max(plan.num_logprobs)
    step = max(1, LOGITS_BYTES // (4 * vocab_size))
    pieces = []
    for begin in range(0, len(indices), step):
        logits = compute_logits(hidden[indices[begin : begin + step]])
        if not is_driver:
            continue
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        target = logprobs.gather(1, targets[begin : begin + step])
        ranks = (logprobs > target).sum(dim=-1) + 1
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        pieces.append((target.squeeze(1), ranks, top_ids, top_logprobs))
    if not is_driver:
        return {}
    target, ranks, top_ids, top_logprobs = (
        torch.cat(p).tolist() for p in zip(*pieces, strict=True)
    )
    target_ids = plan.target_ids.tolist()
    out = {}
    for i, req_id in enumerate(plan.req_ids):
        n = plan.num_logprobs[i]
        out[req_id] = PromptLogprobs(
            plan.starts[i],
            [
                TokenLogprobs(
                    [target_ids[j]] + top_ids[j][:n],
                    [target[j]] + top_logprobs[j][:n],
                    ranks[j],
                )
                for j in range(plan.offsets[i], plan.offsets[i + 1])
            ],
        )
    return out
