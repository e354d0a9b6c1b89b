"""A step's end: its samples copied to the host, appended to their requests and reported.

A launched step's samples travel to the host while the device may already run the next
step, so they are appended to the rows their requests hold by then (found by request id:
the next step's update may have moved, removed or finished them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import ModelRunnerOutput, TokenLogprobs
from worker.input_batch import CachedRequestState, InputBatch
from worker.sampler import LogprobsTensors


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; `finish_step` answers it."""

    step_id: int
    req_ids: list[str]  # the batch's rows when it launched
    sample_rows: np.ndarray  # of those rows, the ones that sampled, in sample order
    sampled: torch.Tensor  # [len(sample_rows)] on the device
    host_sampled: torch.Tensor  # their copy on the host, complete once `copied` is
    copied: torch.cuda.Event | None
    logprobs: LogprobsTensors | None
    num_logprobs: np.ndarray | None  # each sample row's logprobs setting
    prompt_logprobs: dict
    failed_requests: dict[str, str]
    output: ModelRunnerOutput | None = None
    idle_before: float = 0.0  # seconds the device sat idle waiting for this step

    @classmethod
    def launch(
        cls,
        step_id: int,
        batch: InputBatch,
        sample_rows: np.ndarray,
        sampled: torch.Tensor,
        logprobs: LogprobsTensors | None,
        prompt_logprobs: dict,
        failed_requests: dict[str, str],
        host_buffer: torch.Tensor | None = None,
    ) -> LaunchedStep:
        """Start the samples' copy from a CUDA device into `host_buffer` (pinned, at
        least as long), asynchronously."""
        copied = None
        host_sampled = sampled
        if sampled.device.type == "cuda":
            host_sampled = host_buffer[: len(sampled)]
            host_sampled.copy_(sampled, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return cls(
            step_id,
            batch.req_ids[: batch.num_reqs],
            sample_rows,
            sampled,
            host_sampled,
            copied,
            logprobs,
            None if logprobs is None else batch.num_logprobs[sample_rows],
            prompt_logprobs,
            failed_requests,
        )

    def done(self) -> bool:
        """Whether its samples are on the host already (always, off CUDA): answering it
        then delays nothing, so it is answered before the next step is prepared."""
        return self.copied is None or self.copied.query()

    def samples_by_request(self) -> dict[str, int]:
        """Request id -> its sample's index in `sampled`."""
        req_ids = self.req_ids
        return {req_ids[row]: i for i, row in enumerate(self.sample_rows.tolist())}


def finish_step(
    batch: InputBatch, requests: dict[str, CachedRequestState], step: LaunchedStep
) -> ModelRunnerOutput:
    """Wait for the step's samples, append each to its request (and to its row, if it
    still has one) and report them in the step's row order."""
    if step.copied is not None:
        step.copied.synchronize()
    sampled = step.host_sampled.tolist()
    req_ids = step.req_ids
    sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
    for row, token_id in zip(step.sample_rows.tolist(), sampled, strict=True):
        sampled_token_ids[row] = [token_id]
        state = requests.get(req_ids[row])
        if state is not None:
            state.output_token_ids.append(token_id)
    if sampled and batch.req_ids[: batch.num_reqs] == req_ids:  # no row moved since launch
        batch.append_token(step.sample_rows, np.array(sampled, dtype=np.int32))
    elif sampled:
        _append_to_current_rows(batch, [req_ids[row] for row in step.sample_rows], sampled)
    output = ModelRunnerOutput(
        step.step_id,
        list(step.req_ids),
        sampled_token_ids,
        _logprobs_per_request(step),
        step.failed_requests,
    )
    output.prompt_logprobs = step.prompt_logprobs
    output.worker_idle_time = step.idle_before
    return output


def _append_to_current_rows(batch: InputBatch, req_ids: list[str], sampled: list[int]) -> None:
    row_of = batch.req_id_to_index
    rows = [row_of.get(req_id) for req_id in req_ids]
    kept = [i for i, row in enumerate(rows) if row is not None]
    if kept:
        batch.append_token(
            np.array([rows[i] for i in kept]), np.array([sampled[i] for i in kept], dtype=np.int32)
        )


def _logprobs_per_request(step: LaunchedStep) -> list[list[TokenLogprobs] | None] | None:
    if step.logprobs is None:
        return None
    token_ids, values, ranks = (t.tolist() for t in step.logprobs)
    per_request: list[list[TokenLogprobs] | None] = [None] * len(step.req_ids)
    for i, row in enumerate(step.sample_rows.tolist()):
        k = int(step.num_logprobs[i])
        if k >= 0:
            entry = TokenLogprobs(token_ids[i][: k + 1], values[i][: k + 1], ranks[i])
            per_request[row] = [entry]
    return per_request
