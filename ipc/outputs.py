"""What the clients and LLM give back, in vLLM's shapes: a RequestOutput per request,
with a CompletionOutput per choice; logprobs as one {token id: Logprob} per position."""

from collections.abc import Callable
from dataclasses import dataclass, field

from ipc.messages import RequestStats, TokenLogprobs


@dataclass
class Logprob:
    """A token's logprob, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprobs_by_token(
    entry: TokenLogprobs, decode: Callable[[int], str] | None = None
) -> dict[int, Logprob]:
    """One position's logprobs as vLLM gives them: the sampled token (or the prompt's) first,
    with its rank, then the top-k ranked 1..k (each token once)."""
    first, *top = entry.token_ids
    out = {first: Logprob(entry.logprobs[0], entry.rank)}
    for rank, (token, logprob) in enumerate(zip(top, entry.logprobs[1:], strict=True), 1):
        out.setdefault(token, Logprob(logprob, rank))
    if decode is not None:
        for token, logprob in out.items():
            logprob.decoded_token = decode(token)
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # What ended a "stop": the stop string or stop token id (None for EOS, as in vLLM).
    stop_reason: int | str | None = None
    # The sum of the sampled tokens' logprobs (None without logprobs).
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One request's result so far: a CompletionOutput per choice (`index` 0..n-1). In a
    stream, `outputs` holds the delta since the previous RequestOutput (of the choices
    that changed); from a blocking call it holds everything.

    `prompt_logprobs` (when asked for): one entry per prompt token, None for the first,
    then {token id: Logprob} of the prompt's token (first) and the top-k at its position.
    In a stream each delta holds the entries that arrived with it (the first delta starts
    with the None), so the deltas' lists add up to the whole.

    `request_stats`: how long the finished request waited, prefilled and decoded in the
    EngineCore, and how often it was preempted (on the delta that finishes it; with n > 1,
    each choice's on the delta finishing it)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt: str | None = None  # the prompt's text, when it was given as text
    request_stats: RequestStats | None = None
    # A KV producer's answer to do_remote_decode: where a consumer pulls the prompt's KV
    # (on the last delta; ipc/kv_transfer.py).
    kv_transfer_params: dict | None = None
