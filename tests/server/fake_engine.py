"""Stand-ins for the engine side of the server: a character-level tokenizer and a scripted
AsyncEngineClient (same methods, same errors, same stream semantics as ipc.client's)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from ipc.bad_words import with_bad_words_token_ids
from ipc.client import EngineDeadError, RequestError
from ipc.client.request_state import RequestState
from ipc.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    TokenLogprobs,
)
from ipc.outputs import RequestOutput
from ipc.sampling_params import SamplingParams

BOS, EOS, OFFSET = 1, 2, 3
VOCAB_SIZE = 0x110000 + OFFSET
REPLY = "The quick brown fox jumps over the lazy dog; héllo, wörld!"


class CharTokenizer:
    """One token per character (id = code point + OFFSET); BOS and EOS are special. It
    has no special-token text, so its chat encoding is the rendered template's."""

    eos_token_id = EOS

    def min_num_tokens(self, text: str) -> int:
        return -(-len(text.encode()) // 4)  # a character is at most 4 bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS] * add_special_tokens + [ord(c) + OFFSET for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        special = {BOS: "<s>", EOS: "</s>"}
        return "".join(
            ("" if skip_special_tokens else special[t]) if t in special else chr(t - OFFSET)
            for t in token_ids
        )

    chat_template_takes_tools = False

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools=None,
        continue_final_message: bool = False,
    ) -> str:
        assert not (add_generation_prompt and continue_final_message)
        text = "<s>" + "".join(f"[{m['role']}] {m['content']}\n" for m in messages)
        if continue_final_message:
            return text[:-1]
        return text + "[assistant] " * add_generation_prompt

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools=None,
        continue_final_message: bool = False,
    ) -> list[int]:
        options = (add_generation_prompt, tools, continue_final_message)
        return self.encode(self.apply_chat_template(messages, *options), False)


class FakeEngineClient:
    """Answers every prompt with REPLY then EOS, one token per `token_delay`; with
    ignore_eos it repeats REPLY up to max_tokens. Records each request's prompt and
    SamplingParams, its cache salt and priority, and the ids of streams stopped before
    they finished (aborts). `failure = (n, error)` makes every request raise `error` after
    n tokens."""

    def __init__(
        self, max_model_len: int | None = None, token_delay: float = 0.005, reply: str = REPLY
    ) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.script = self.tokenizer.encode(reply, add_special_tokens=False) + [EOS]
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []
        self.salts: dict[str, str | None] = {}
        self.priorities: dict[str, int] = {}
        self.live: set[str] = set()
        self.results: dict[str, RequestOutput] = {}
        self.failure: tuple[int, Exception] | None = None
        self.alive = True
        self._stats = SchedulerStats()

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def health(self, timeout: float = 5.0) -> bool:
        return self.alive

    async def stats(self, timeout: float = 30.0) -> SchedulerStats:
        self._check_alive()
        return self._stats

    async def engine_stats(self, timeout: float = 30.0) -> list[SchedulerStats | None]:
        return [self._stats if self.alive else None]

    def engine_index(self, request_id: str) -> int:
        return 0

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        async for delta in self.stream(prompt, sampling_params, request_id, priority, cache_salt):
            if delta.finished:
                return self.results.pop(delta.request_id)
        raise AssertionError("the fake stream ended unfinished")

    async def stream(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's tokens go through the engine client's own RequestState
        (detokenization, stop strings, stop reasons)."""
        self._check_alive()
        params = with_bad_words_token_ids(sampling_params or SamplingParams(), self.tokenizer)
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens exceeds max_model_len {self.max_model_len}"
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.live:
            raise ValueError(f"request id {request_id!r} is already running")
        self.requests[request_id] = (prompt_ids, params)
        self.salts[request_id] = cache_salt
        self.priorities[request_id] = priority
        self._stats.num_prompt_tokens += len(prompt_ids)
        request = EngineCoreRequest(request_id, prompt_ids, params, time.time(), priority)
        state = RequestState(request, self.tokenizer, None)
        finished = False
        self.live.add(request_id)
        try:
            for step in range(params.max_tokens or 10_000):
                await asyncio.sleep(self.token_delay)
                self._check_alive()
                if self.failure is not None and step == self.failure[0]:
                    raise self.failure[1]
                token = self.script[step % len(self.script)]
                self._stats.num_generation_tokens += 1
                logprobs = None if params.logprobs is None else [self._logprobs(token, params)]
                reason = self._finish_reason(params, step + 1, token)
                out = EngineCoreOutput(request_id, [token], reason, 0, logprobs)
                if step == 0 and params.prompt_logprobs is not None:
                    out.prompt_logprobs = self.prompt_logprobs(prompt_ids, params.prompt_logprobs)
                delta = state.apply(out)
                finished = delta.finished
                if finished:
                    self.results[request_id] = state.result
                yield delta
                if finished:
                    return
        finally:
            self.live.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    @staticmethod
    def _finish_reason(params: SamplingParams, num_tokens: int, token: int) -> FinishReason | None:
        stops = params.stop_token_ids + ([] if params.ignore_eos else [EOS])
        if token in stops and num_tokens > params.min_tokens:
            return FinishReason.STOP
        return FinishReason.LENGTH if num_tokens == params.max_tokens else None

    @staticmethod
    def _logprobs(token: int, params: SamplingParams) -> TokenLogprobs:
        """The sampled token at -0.25 (rank 1), then the top-k: itself, then tokens
        token+1.. at -1, -2, ..."""
        top = list(range(params.logprobs))
        logprobs = [-0.25] + [-float(k) or -0.25 for k in top]
        return TokenLogprobs([token] + [token + k for k in top], logprobs, 1)

    @staticmethod
    def prompt_logprobs(prompt_ids: list[int], k: int) -> list[TokenLogprobs]:
        """Prompt token p at -p / 8 with rank p, then top-k tokens BOS + 1.. at -1, -2, ..."""
        top = list(range(1, k + 1))
        return [
            TokenLogprobs([t] + [BOS + i for i in top], [-p / 8] + [-float(i) for i in top], p)
            for p, t in enumerate(prompt_ids[1:], 1)
        ]

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError("the fake engine is down")
