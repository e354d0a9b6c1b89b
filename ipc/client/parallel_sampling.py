"""Parallel sampling: a request with n > 1 (or best_of > n) runs in the engine as one
child request per candidate, and its children's outputs fold back into one
RequestOutput whose `outputs` hold a choice per index.

The children share the prompt, and the engine computes it once: the prefix cache caches
a block when it is allocated, and the scheduler admits a waiting request only once every
running one has its whole prompt scheduled (a partial prefill chunk takes the rest of
the step's budget), so a child admitted after its sibling finds the prompt's full blocks
cached, in the same step or a later one. Each child draws its own random stream: seed +
index when the request has a seed, else the engine's generator for unseeded rows, which
gives every row its own draws. Stop strings, logprobs and detokenization are each child's
own (a RequestState each, which the OutputProcessor maps to its parent). With best_of > n
the children also return their sampled tokens' logprobs, and the n with the highest
cumulative logprob are the answer, known only when every candidate has finished: such a
request cannot stream.
"""

from __future__ import annotations

import math

import msgspec

from ipc.client.request_state import RequestState, Sink
from ipc.messages import EngineCoreRequest
from ipc.outputs import CompletionOutput, RequestOutput
from ipc.sampling_params import SamplingParams


def num_candidates(params: SamplingParams) -> int:
    return params.best_of or params.n


def is_parallel(params: SamplingParams) -> bool:
    return params.n > 1 or (params.best_of or 1) > 1


def check_streamable(params: SamplingParams | None) -> None:
    if params is not None and num_candidates(params) > params.n:
        raise ValueError(
            "best_of must equal n when streaming: the n answers are known only when all "
            f"best_of candidates have finished (got best_of={params.best_of}, n={params.n})"
        )


def child_requests(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """One request per candidate, with n=1, ids f"{index}_{parent id}", and seed + index.
    Only the first asks for prompt logprobs (the others may then take the prompt from
    the prefix cache)."""
    params = request.sampling_params
    logprobs = params.logprobs
    if logprobs is None and num_candidates(params) > params.n:
        logprobs = 0  # the sampled token's logprob alone: what best_of ranks by
    return [
        msgspec.structs.replace(
            request,
            request_id=f"{index}_{request.request_id}",
            sampling_params=msgspec.structs.replace(
                params,
                n=1,
                best_of=None,
                seed=None if params.seed is None else params.seed + index,
                logprobs=logprobs,
                prompt_logprobs=params.prompt_logprobs if index == 0 else None,
            ),
        )
        for index in range(num_candidates(params))
    ]


class ParentRequest:
    """A request with several candidates, as a client sees it: the states of its
    children (of child_requests(request), choice `index` each) and its own cumulative
    result, which `fold` builds from the children's deltas. In a stream, a delta holds the
    choices that changed; it is `finished` once every child is."""

    def __init__(
        self,
        request: EngineCoreRequest,
        children: list[RequestState],
        queue: Sink | None = None,
        prompt: str | None = None,
    ) -> None:
        self.request = request
        self.queue = queue
        self.children = children
        self.num_live = len(self.children)
        self.result = RequestOutput(request.request_id, request.prompt_token_ids, prompt=prompt)
        if request.sampling_params.prompt_logprobs is not None:
            self.result.prompt_logprobs = self.children[0].result.prompt_logprobs

    def live_request_ids(self) -> list[str]:
        return [c.request.request_id for c in self.children if not c.result.finished]

    def fold(self, delta: RequestOutput) -> RequestOutput:
        """The parent's delta for a child's delta."""
        result = self.result
        result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
        if delta.finished:
            self.num_live -= 1
            result.error = result.error or delta.error
            if self.num_live == 0:
                self._finish()
        return RequestOutput(
            result.request_id,
            result.prompt_token_ids,
            delta.outputs,
            result.finished,
            result.num_cached_tokens,
            result.error,
            delta.prompt_logprobs,
            result.prompt,
            delta.request_stats,
        )

    def abort(self) -> RequestOutput:
        """Finish every live child with "abort"; the last delta holds their choices."""
        choices: list[CompletionOutput] = []
        for child in self.children:
            if not child.result.finished:
                choices += self.fold(child.abort()).outputs
        result = self.result
        return RequestOutput(
            result.request_id,
            result.prompt_token_ids,
            choices,
            True,
            result.num_cached_tokens,
            result.error,
            prompt=result.prompt,
        )

    def _finish(self) -> None:
        params = self.request.sampling_params
        choices = [child.result.outputs[0] for child in self.children]
        if len(choices) > params.n:
            choices = sorted(choices, key=_cumulative_logprob, reverse=True)[: params.n]
            for index, choice in enumerate(choices):
                choice.index = index
                if params.logprobs is None:
                    choice.logprobs = None  # asked for internally, to rank by
        self.result.outputs = choices
        self.result.finished = True


def _cumulative_logprob(choice: CompletionOutput) -> float:
    value = choice.cumulative_logprob
    return -math.inf if value is None else value
