from dataclasses import dataclass, field

from ipc.messages import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
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
    then TokenLogprobs whose index 0 is the prompt token (with its `rank`), then the
    top-k at its position. In a stream each delta holds the entries that arrived with
    it (the first delta starts with the None), so the deltas' lists add up to the whole."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt: str | None = None  # the prompt's text, when it was given as text
