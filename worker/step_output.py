"""A step's end: its samples copied to the host, appended to their requests and reported.

A launched step's samples travel to the host while the device may already run the next
step, so they are appended to the rows their requests hold by then (found by request id:
the next step's update may have moved, removed or finished them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import KVConnectorOutput, ModelRunnerOutput, TokenLogprobs
from worker.input_batch import CachedRequestState, InputBatch
from worker.sampler import LogprobsTensors, skip_sample_draws


@dataclass
class DraftVerification:
    """A step's sample rows that verify drafts: `num_logits[i]` logits rows for sample row i
    (its drafts + 1), `drafts[i]` its drafts, and the generator states of its seeded rows
    before the step drew (sample row -> (generator, state)).

    Each position is sampled as if the drafts before it were the row's tokens; a draft is
    accepted while it equals the token sampled at its position, and the first token that
    differs (or the one after the last draft) ends the row's tokens. For drafts that are a
    point mass (prompt lookup) this is exact rejection sampling: a draft d is accepted with
    probability p(d), and otherwise the token comes from p without d, renormalised. A
    seeded row's generator is then set back to as many draws as tokens it produced, so its
    stream is the one it would have drawn without drafts."""

    num_logits: np.ndarray
    drafts: list[list[int]]
    generator_states: dict[int, tuple[torch.Generator, torch.Tensor]]

    def accept(self, sampled: list[int]) -> list[tuple[int, list[int]]]:
        """Per sample row: (its first logits row, the tokens it produced)."""
        out = []
        start = 0
        for i, n in enumerate(self.num_logits.tolist()):
            samples, drafts = sampled[start : start + n], self.drafts[i]
            m = 0
            while m < len(drafts) and samples[m] == drafts[m]:
                m += 1
            out.append((start, samples[: m + 1]))
            entry = self.generator_states.get(i)
            if entry is not None:
                generator, state = entry
                generator.set_state(state)
                skip_sample_draws(generator, m + 1)
            start += n
        return out


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
    verification: DraftVerification | None = None
    propose_drafts: bool = False  # the draft model drafts once the step is answered
    output: ModelRunnerOutput | None = None
    idle_before: float = 0.0  # seconds the device sat idle waiting for this step
    kv_connector_output: KVConnectorOutput | None = None

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
        verification: DraftVerification | None = None,
        logits_rows: np.ndarray | None = None,
    ) -> LaunchedStep:
        """Start the samples' copy from a CUDA device into `host_buffer` (pinned, at
        least as long), asynchronously. `logits_rows`: the batch row of each sample
        (sample_rows when no row verifies drafts)."""
        if logits_rows is None:
            logits_rows = sample_rows
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
            None if logprobs is None else batch.num_logprobs[logits_rows],
            prompt_logprobs,
            failed_requests,
            verification,
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
    if step.verification is not None:
        return _finish_verification(batch, requests, step, sampled)
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


def _finish_verification(
    batch: InputBatch,
    requests: dict[str, CachedRequestState],
    step: LaunchedStep,
    sampled: list[int],
) -> ModelRunnerOutput:
    """A step with drafts: each sample row produces its accepted drafts and one token."""
    req_ids = step.req_ids
    sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
    logprobs = _logprobs_per_logits_row(step)
    per_request: list[list[TokenLogprobs] | None] | None = None
    if logprobs is not None:
        per_request = [None] * len(req_ids)
    accepted = step.verification.accept(sampled)
    row_of = batch.req_id_to_index
    for row, (first, token_ids) in zip(step.sample_rows.tolist(), accepted, strict=True):
        req_id = req_ids[row]
        sampled_token_ids[row] = token_ids
        state = requests.get(req_id)
        if state is not None:
            state.output_token_ids.extend(token_ids)
        current = row_of.get(req_id)
        if current is not None:
            batch.append_tokens(current, token_ids)
        if logprobs is not None and logprobs[first] is not None:
            per_request[row] = logprobs[first : first + len(token_ids)]
    output = ModelRunnerOutput(
        step.step_id, list(req_ids), sampled_token_ids, per_request, step.failed_requests
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
    entries = _logprobs_per_logits_row(step)
    if entries is None:
        return None
    per_request: list[list[TokenLogprobs] | None] = [None] * len(step.req_ids)
    for i, row in enumerate(step.sample_rows.tolist()):
        if entries[i] is not None:
            per_request[row] = [entries[i]]
    return per_request


def _logprobs_per_logits_row(step: LaunchedStep) -> list[TokenLogprobs | None] | None:
    """Each logits row's entry, None for rows of requests that want no logprobs."""
    if step.logprobs is None:
        return None
    token_ids, values, ranks = (t.tolist() for t in step.logprobs)
    settings = step.num_logprobs.tolist()
    entries: list[TokenLogprobs | None] = []
    for i, k in enumerate(settings):
        entry = None
        if k >= 0:
            entry = TokenLogprobs(token_ids[i][: k + 1], values[i][: k + 1], ranks[i])
        entries.append(entry)
    return entries
