"""A step's answer applied to its requests: the sampled tokens appended, stop conditions
checked token by token, grammars advanced, and each request's EngineCoreOutput made."""

from __future__ import annotations

import time

from engine_core.request import Request, RequestStatus
from engine_core.scheduler_stats import SchedulerCounters
from engine_core.structured_output import GRAMMAR_REJECTED, StructuredOutputManager
from ipc.messages import EngineCoreOutput, ErrorCode, ModelRunnerOutput

_GRAMMAR_ERROR = {"error": GRAMMAR_REJECTED, "error_code": ErrorCode.INTERNAL}


def update_requests(
    model_runner_output: ModelRunnerOutput,
    requests: dict[str, Request],
    max_model_len: int,
    structured_output: StructuredOutputManager,
    counters: SchedulerCounters,
) -> tuple[list[EngineCoreOutput], list[tuple[Request, RequestStatus]]]:
    """The outputs of the requests that got a token or prompt logprobs, and the requests
    that finished with their status (the caller frees them)."""
    outputs = []
    finished = []
    num_generated = 0
    grammars = structured_output.matchers
    logprobs = model_runner_output.logprobs  # None, or one entry per request
    prompt_logprobs = {
        request_id: requests[request_id].take_prompt_logprobs(chunk)
        for request_id, chunk in model_runner_output.prompt_logprobs.items()
        if request_id in requests
    }
    for i, (request_id, token_ids) in enumerate(
        zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True)
    ):
        request = requests.get(request_id)
        if request is None or not token_ids:
            continue
        request.num_output_placeholders -= 1
        if not request.output_token_ids:
            counters.num_prompt_tokens += request.num_prompt_tokens
            request.first_token_time = time.monotonic()
        new_token_ids = []
        status = None
        for token_id in token_ids:
            request.append_output_token_id(token_id)
            new_token_ids.append(token_id)
            status = check_stop(request, token_id, max_model_len)
            if status is not None:
                break
        if status is None and request_id in grammars:
            status = structured_output.accept_tokens(request, new_token_ids)
        num_generated += len(new_token_ids)
        if status is not None:
            finished.append((request, status))
        outputs.append(
            EngineCoreOutput(
                request_id,
                new_token_ids,
                None if status is None else status.finish_reason,
                request.num_cached_tokens,
                logprobs[i][: len(new_token_ids)] if logprobs and logprobs[i] else None,
                prompt_logprobs=prompt_logprobs.pop(request_id, None) or None,
                request_stats=None if status is None else request.stats(),
                **_GRAMMAR_ERROR if status == RequestStatus.FINISHED_ERROR else {},
            )
        )
    for request_id, entries in prompt_logprobs.items():  # chunks that sampled nothing
        if entries:
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [],
                    num_cached_tokens=requests[request_id].num_cached_tokens,
                    prompt_logprobs=entries,
                )
            )
    counters.num_generation_tokens += num_generated
    return outputs, finished


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    num_output = request.num_output_tokens
    # A stop token counts only once min_tokens tokens precede it (as in HF generate).
    if num_output > request.min_tokens and token_id in request.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if num_output == request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
