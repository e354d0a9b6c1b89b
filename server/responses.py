"""OpenAI response objects for one request: the whole response, or its stream chunks.

A builder holds what every object of a request repeats (id, creation time, model) and
the state that runs across chunks (each choice's text offset for logprobs). A request
with n > 1 has choices 0..n-1; each chunk carries one choice's delta, with its index.
"""

from __future__ import annotations

import time

from ipc.messages import TokenLogprobs
from ipc.outputs import CompletionOutput
from ipc.tokenizer import TokenizerLike


class ResponseBuilder:
    object_name = ""
    chunk_object_name = ""

    def __init__(
        self, request_id: str, model: str, tokenizer: TokenizerLike, prompt_tokens_details: bool
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_tokens_details = prompt_tokens_details
        self.created = int(time.time())
        self.num_choices = 1

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(self, choices: list[CompletionOutput], usage: dict) -> dict:
        """The whole response; each choice's logprobs None unless asked for."""
        body = [
            self._choice(c.index, c.text, c.logprobs, c.finish_reason, c.stop_reason)
            for c in choices
        ]
        return {**self._envelope(self.object_name, body), "usage": usage}

    def chunk(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict:
        choice = self._chunk_choice(index, text, logprobs, finish_reason, stop_reason)
        return self._envelope(self.chunk_object_name, [choice])

    def first_chunks(self) -> list[dict]:
        return []

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage}

    def usage(
        self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int
    ) -> dict:
        """The cached-token count only with prompt_tokens_details (vLLM's
        --enable-prompt-tokens-details): it tells a client what others have sent."""
        usage = {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
        }
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
        return usage

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        raise NotImplementedError


class CompletionResponses(ResponseBuilder):
    """`echo`: the prompt text, put before each choice's completion (its first chunk's,
    streaming)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.text_offsets: dict[int, int] = {}
        self.echo = ""
        self._echoed: set[int] = set()

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            text = self.echo + text
        return {
            "index": index,
            "text": text,
            "logprobs": None if logprobs is None else self._logprobs(index, logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    _chunk_choice = _choice

    def _logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict:
        """OpenAI's legacy shape; each top_logprobs dict holds the sampled token and the
        top-k, so it has up to k + 1 entries."""
        tokens, offsets = [], []
        offset = self.text_offsets.get(index, 0)
        for entry in entries:
            token = self._token_text(entry.token_ids[0])
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[index] = offset
        top = [
            {self._token_text(t): lp for t, lp in zip(e.token_ids, e.logprobs, strict=True)}
            for e in entries
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprobs[0] for entry in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }


class ChatResponses(ResponseBuilder):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _chunk_choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        return {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": None if logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def first_chunks(self) -> list[dict]:
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for index in range(self.num_choices)
        ]

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict:
        content = []
        for entry in entries:
            top = [
                self._logprob(t, lp)
                for t, lp in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
            ]
            content.append(
                {**self._logprob(entry.token_ids[0], entry.logprobs[0]), "top_logprobs": top}
            )
        return {"content": content, "refusal": None}

    def _logprob(self, token_id: int, logprob: float) -> dict:
        token = self._token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
