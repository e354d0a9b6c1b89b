"""A request as the scheduler sees it: its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from ipc.messages import (
    EngineCoreRequest,
    FinishReason,
    PromptLogprobs,
    RequestStats,
    TokenLogprobs,
)
from ipc.sampling_params import SamplingParams
from kv_cache import extend_block_hashes


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1  # its prompt's KV is being pulled from a producer
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One generation request. `num_computed_tokens` chases `num_tokens`; the request is
    decoding when they differ by one. `stop_token_ids` merges the sampling stop tokens
    with the EOS ids (unless ignore_eos), so a stop check is one set lookup."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        stop_ids = frozenset(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            stop_ids |= self.eos_token_ids
        self.stop_token_ids = stop_ids
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens being sampled by steps already sent whose outputs have not come back
        # (async scheduling): the workers feed them into the next steps themselves.
        self.num_output_placeholders = 0
        # Prompt tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # time.monotonic() when the EngineCore took it, first scheduled it, sampled its
        # first token: its RequestStats when it finishes.
        self.queued_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Prompt tokens whose logprobs were sent (tokens 1..n): a recomputed prompt
        # sends only those after them.
        self.num_prompt_logprobs_sent = 0
        # False until the workers have the request's state (again, after they were replaced).
        self.on_workers = False
        # A consumer pulls a remote prefill's KV once (kv_connector.py).
        self.remote_prefill_tried = False
        self.block_hashes: list[bytes] = []
        self._hash_block_size: int | None = None

    def stats(self) -> RequestStats | None:
        """Its phases so far (the decode up to now); None before its first token."""
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        now = time.monotonic()
        return RequestStats(
            self.scheduled_time - self.queued_time,
            self.first_token_time - self.scheduled_time,
            now - self.first_token_time,
            self.num_preemptions,
        )

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, eos_token_ids: Iterable[int] = ()
    ) -> Request:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_ids,
            request.arrival_time,
            request.priority,
            request.cache_salt,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all sent: cached positions would have none."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.num_prompt_logprobs_sent < self.num_prompt_tokens - 1
        )

    def take_prompt_logprobs(self, chunk: PromptLogprobs) -> list[TokenLogprobs]:
        """The entries of `chunk` not sent before."""
        entries = chunk.logprobs[max(0, self.num_prompt_logprobs_sent + 1 - chunk.start) :]
        self.num_prompt_logprobs_sent = max(
            self.num_prompt_logprobs_sent, chunk.start + len(chunk.logprobs) - 1
        )
        return entries

    def enable_block_hashing(self, block_size: int) -> None:
        """Hash the full blocks so far, and from now on each block as it fills."""
        self._hash_block_size = block_size
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.cache_salt)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        block_size = self._hash_block_size
        if block_size and len(self.all_token_ids) // block_size > len(self.block_hashes):
            extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.cache_salt)
