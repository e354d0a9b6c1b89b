"""A step's end: the sampled tokens appended to the persistent batch and their requests,
and the ModelRunnerOutput that reports them."""

from __future__ import annotations

import numpy as np

from ipc.messages import ModelRunnerOutput, TokenLogprobs
from worker.input_batch import CachedRequestState, InputBatch


def finish_step(
    batch: InputBatch,
    requests: dict[str, CachedRequestState],
    step_id: int,
    sample_rows: np.ndarray,
    sampled: list[int],
    logprobs,
    failed_requests: dict[str, str],
) -> ModelRunnerOutput:
    req_ids = batch.req_ids[: batch.num_reqs]
    sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
    if sampled:
        batch.append_token(sample_rows, np.array(sampled, dtype=np.int32))
    for row, token_id in zip(sample_rows.tolist(), sampled, strict=True):
        requests[req_ids[row]].output_token_ids.append(token_id)
        sampled_token_ids[row] = [token_id]
    return ModelRunnerOutput(
        step_id,
        list(req_ids),
        sampled_token_ids,
        _logprobs_per_request(batch, sample_rows, logprobs, len(req_ids)),
        failed_requests,
    )


def _logprobs_per_request(batch: InputBatch, sample_rows: np.ndarray, logprobs, num_reqs: int):
    if logprobs is None:
        return None
    token_ids, values = (t.tolist() for t in logprobs)
    per_request: list[list[TokenLogprobs] | None] = [None] * num_reqs
    for i, row in enumerate(sample_rows.tolist()):
        k = batch.num_logprobs[row]
        if k >= 0:
            per_request[row] = [TokenLogprobs(token_ids[i][: k + 1], values[i][: k + 1])]
    return per_request
