"""OpenAI response objects for one request: the whole response, or its stream chunks.

A builder holds what every object of a request repeats (id, creation time, model) and
the state that runs across chunks (the completion's text offset for logprobs).
"""

from __future__ import annotations

import time

from ipc.messages import TokenLogprobs
from ipc.tokenizer import TokenizerLike
from server.tools import ToolCallOutput, ToolChoice


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

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(
        self,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        usage: dict,
    ) -> dict:
        choice = self._choice(text, logprobs, finish_reason, stop_reason)
        return {**self._envelope(self.object_name, [choice]), "usage": usage}

    def chunk(
        self,
        text: str,
        logprobs: list[TokenLogprobs] | None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict | None:
        """A chunk, or None when there is nothing to send yet."""
        choice = self._chunk_choice(text, logprobs, finish_reason, stop_reason)
        return None if choice is None else self._envelope(self.chunk_object_name, [choice])

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

    def _choice(self, text, logprobs, finish_reason, stop_reason) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, text, logprobs, finish_reason, stop_reason) -> dict:
        raise NotImplementedError


class CompletionResponses(ResponseBuilder):
    """`echo`: the prompt text, put before the completion (the first chunk's, streaming)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.text_offset = 0
        self.echo = ""

    def _choice(self, text, logprobs, finish_reason, stop_reason) -> dict:
        text, self.echo = self.echo + text, ""
        return {
            "index": 0,
            "text": text,
            "logprobs": None if logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    _chunk_choice = _choice

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict:
        """OpenAI's legacy shape; each top_logprobs dict holds the sampled token and the
        top-k, so it has up to k + 1 entries."""
        tokens, offsets = [], []
        for entry in entries:
            token = self._token_text(entry.token_ids[0])
            tokens.append(token)
            offsets.append(self.text_offset)
            self.text_offset += len(token)
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
    """`tools`: what the request asks of tools (server/tools.py); the text becomes tool
    calls through it."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools: ToolChoice | None = None
        self._tool_output: ToolCallOutput | None = None

    def _choice(self, text, logprobs, finish_reason, stop_reason) -> dict:
        message = {"role": "assistant", "content": text}
        if self.tools is not None:
            message, finish_reason = self.tools.output().message(text, finish_reason)
        return {
            "index": 0,
            "message": message,
            "logprobs": None if logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _chunk_choice(self, text, logprobs, finish_reason, stop_reason) -> dict | None:
        """None when there is nothing to send yet (text held back as a possible tool call)."""
        delta = {"content": text} if text else {}
        if self.tools is not None:
            if self._tool_output is None:
                self._tool_output = self.tools.output()
            delta = self._tool_output.feed(text)
            if finish_reason is not None:
                last, finish_reason = self._tool_output.finish(finish_reason)
                delta = _merge_deltas(delta, last)
            elif not delta and logprobs is None:
                return None
        return {
            "index": 0,
            "delta": delta,
            "logprobs": None if logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def first_chunks(self) -> list[dict]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._envelope(self.chunk_object_name, [choice])]

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


def _merge_deltas(first: dict, second: dict) -> dict:
    """One delta of two: contents joined, tool-call pieces listed."""
    merged = {**first, **second}
    if "content" in first and "content" in second:
        merged["content"] = first["content"] + second["content"]
    if "tool_calls" in first and "tool_calls" in second:
        merged["tool_calls"] = first["tool_calls"] + second["tool_calls"]
    return merged
