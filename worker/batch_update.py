"""A step's changes to a worker's requests and persistent batch, from its SchedulerOutput."""

from __future__ import annotations

import logging

import torch

from ipc.messages import NewRequestData, SchedulerOutput
from worker.input_batch import CachedRequestState, InputBatch, check_new_request

logger = logging.getLogger(__name__)


def update_batch(
    batch: InputBatch,
    requests: dict[str, CachedRequestState],
    so: SchedulerOutput,
    device: torch.device,
) -> dict[str, str]:
    """Finished requests leave; rows not scheduled leave the batch (their requests stay);
    new requests join; known ones take their new blocks and computed counts (a resumed one
    its whole state); then the rows are condensed. Returns {request id: why} of the new
    requests that failed on this rank."""
    for req_id in so.finished_req_ids:
        requests.pop(req_id, None)
        batch.remove_request(req_id)
    for req_id in list(batch.req_id_to_index):
        if req_id not in so.num_scheduled_tokens:
            batch.remove_request(req_id)
    failed = {}
    for new in so.scheduled_new_reqs:
        error = _add_new_request(batch, requests, new, device)
        if error is not None:
            failed[new.req_id] = error
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        state = requests.get(req_id)
        if state is None:  # failed on an earlier step; the engine is finishing it
            continue
        state.num_computed_tokens = cached.num_computed_tokens[i]
        new_block_ids = cached.new_block_ids[i]
        row = batch.req_id_to_index.get(req_id)
        if cached.resumed_from_preemption[i]:
            state.block_ids = [list(ids) for ids in new_block_ids]
            state.output_token_ids = cached.new_token_ids[i][len(state.prompt_token_ids) :]
            state.draft_num_computed = 0
            if row is not None:
                batch.remove_request(req_id)
            batch.add_request(state)
            continue
        grows = any(new_block_ids)  # most decode steps add no block
        if grows:
            for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                ids.extend(new_ids)
        if row is None:
            batch.add_request(state)
        else:
            batch.num_computed_tokens[row] = state.num_computed_tokens
            if grows:
                batch.block_table.append_row(new_block_ids, row)
    batch.condense()
    batch.set_draft_tokens(so.scheduled_spec_decode_tokens)
    return failed


def _add_new_request(
    batch: InputBatch,
    requests: dict[str, CachedRequestState],
    new: NewRequestData,
    device: torch.device,
) -> str | None:
    """A request the batch cannot take fails alone: it is reported in this step's output
    and left out of the forward pass; every rank decides the same way."""
    try:
        error = check_new_request(new, batch.vocab_size)
        if error is None:
            state = CachedRequestState.from_new_request(new, device)
            batch.add_request(state)
            requests[new.req_id] = state
            return None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    logger.warning("request %s failed on this rank: %s", new.req_id, error)
    return error
