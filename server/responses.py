"""OpenAI response objects for one request: the whole response, or its stream chunks.

A builder holds what every object of a request repeats (id, creation time, model) and
the state that runs across chunks (each choice's text offset for logprobs, the prompt
logprobs that arrived and which choices answered them). A request with n > 1 has choices
0..n-1; each chunk carries one choice's delta, with its index.

Logprobs arrive as the clients give them: one {token id: Logprob} per position, the
sampled (or prompt) token first. Prompt logprobs take vLLM's shape: a list with null for
the first prompt token, then for each token {"<token id>": {"logprob", "rank",
"decoded_token"}} of the prompt's token and the top-k at its position; in each completion
choice, at the top of a chat response.
"""

from __future__ import annotations

import time

from ipc.outputs import CompletionOutput, Logprob
from ipc.tokenizer import TokenizerLike
from server.tools import ToolCallOutput, ToolChoice

Logprobs = dict[int, Logprob]  # one position's, by token id


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
        self.prompt_token_ids: list[int] = []
        self.show_prompt_logprobs = False  # the request's `prompt_logprobs`
        self.first_index = 0  # choice 0's index in the response (a batch's later prompts)
        self.return_token_ids = False  # vLLM's: the prompt's and each choice's token ids
        self.tokens_as_ids = False  # vLLM's return_tokens_as_token_ids: "token_id:<id>"
        self._held_token_ids: dict[int, list[int]] = {}  # by choice, of chunks not sent
        self._prompt_logprobs: list[Logprobs | None] = []
        self._prompt_logprobs_sent: dict[int, int] = {}  # choice index -> entries answered

    def add_prompt_logprobs(self, entries: list[Logprobs | None] | None) -> None:
        """Prompt logprobs that arrived; each choice's next response or chunk answers them."""
        self._prompt_logprobs.extend(entries or ())

    def _take_prompt_logprobs(self, index: int) -> list[Logprobs | None]:
        """The prompt logprobs choice `index` has not answered yet."""
        sent = self._prompt_logprobs_sent.get(index, 0)
        self._prompt_logprobs_sent[index] = len(self._prompt_logprobs)
        return self._prompt_logprobs[sent:]

    def _prompt_logprobs_field(self, entries: list[Logprobs | None]) -> list[dict | None]:
        return [None if entry is None else self._ranked(entry) for entry in entries]

    def _ranked(self, entry: Logprobs) -> dict:
        return {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._text(t, lp)}
            for t, lp in entry.items()
        }

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
            self._numbered(
                self._choice(c.index, c.text, c.logprobs, c.finish_reason, c.stop_reason),
                c.token_ids,
            )
            for c in choices
        ]
        return {**self._envelope(self.object_name, body), "usage": usage}

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[Logprobs] | None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict | None:
        """A chunk, or None when there is nothing to send yet (its token ids then go with
        the choice's next chunk)."""
        choice = self._chunk_choice(index, text, logprobs, finish_reason, stop_reason)
        if self.return_token_ids:
            token_ids = self._held_token_ids.pop(index, []) + token_ids
            if choice is None:
                self._held_token_ids[index] = token_ids
        if choice is None:
            return None
        return self._envelope(self.chunk_object_name, [self._numbered(choice, token_ids)])

    def _numbered(self, choice: dict, token_ids: list[int]) -> dict:
        """The choice with its index in the response and, asked for, its token ids."""
        if self.return_token_ids:
            self._add_token_ids(choice, token_ids)
        choice["index"] += self.first_index
        return choice

    def _add_token_ids(self, choice: dict, token_ids: list[int]) -> None:
        choice["token_ids"] = token_ids

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

    def _text(self, token_id: int, logprob: Logprob | None = None) -> str:
        """A token's text: its logprob's decoded_token, or decoded here."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprob_token(self, token_id: int, logprob: Logprob | None = None) -> str:
        """How a logprobs entry names a token."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self._text(token_id, logprob)

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        raise NotImplementedError


class CompletionResponses(ResponseBuilder):
    """`echo`: the prompt text, put before each choice's completion (its first chunk's,
    streaming); with `echo_logprobs` the prompt tokens' logprobs lead each choice's
    logprobs."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.text_offsets: dict[int, int] = {}
        self.echo = ""
        self.echo_logprobs = False
        self._echoed: set[int] = set()
        self._ids_sent: set[int] = set()  # choices that were sent the prompt's token ids

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            text = self.echo + text
        prompt = self._take_prompt_logprobs(index)
        if self.echo_logprobs and prompt:
            logprobs = prompt + (logprobs or [])
        choice = {
            "index": index,
            "text": text,
            "logprobs": None if logprobs is None else self._logprobs(index, logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.show_prompt_logprobs and prompt:
            choice["prompt_logprobs"] = self._prompt_logprobs_field(prompt)
        return choice

    _chunk_choice = _choice

    def _add_token_ids(self, choice: dict, token_ids: list[int]) -> None:
        """The prompt's token ids ride with each choice's first chunk (vLLM's shape)."""
        first = choice["index"] not in self._ids_sent
        self._ids_sent.add(choice["index"])
        choice["prompt_token_ids"] = self.prompt_token_ids if first else None
        super()._add_token_ids(choice, token_ids)

    def _logprobs(self, index: int, entries: list[Logprobs | None]) -> dict:
        """OpenAI's legacy shape; each top_logprobs dict holds the sampled token and the
        top-k, so it has up to k + 1 entries. A None entry is the echoed first prompt
        token, which has no logprob."""
        tokens, offsets, token_logprobs, top = [], [], [], []
        offset = self.text_offsets.get(index, 0)
        for entry in entries:
            if entry is None:
                token = self._logprob_token(self.prompt_token_ids[0])
            else:
                token_id, logprob = next(iter(entry.items()))
                token = self._logprob_token(token_id, logprob)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(logprob.logprob)
            top.append({self._logprob_token(t, lp): lp.logprob for t, lp in entry.items()})
        self.text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


class ChatResponses(ResponseBuilder):
    """`tools`: what the request asks of tools (server/tools.py); the text becomes tool
    calls through it. `echo`: text that leads each choice's content (vLLM's chat echo:
    the final message's, when it is the assistant's)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools: ToolChoice | None = None
        self.echo = ""
        self.top_logprobs = 0  # the request's
        self._tool_outputs: dict[int, ToolCallOutput] = {}  # by choice index, streaming

    def response(self, choices: list[CompletionOutput], usage: dict) -> dict:
        body = super().response(choices, usage)
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        if self.show_prompt_logprobs:
            body["prompt_logprobs"] = self._prompt_logprobs_field(self._take_prompt_logprobs(0))
        return body

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        message = {"role": "assistant", "content": text}
        if self.tools is not None:
            message, finish_reason = self.tools.output().message(text, finish_reason)
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        return {
            "index": index,
            "message": message,
            "logprobs": None if logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _chunk_choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict | None:
        """None when there is nothing to send yet (text held back as a possible tool call)."""
        delta = {"content": text} if text else {}
        if self.tools is not None:
            output = self._tool_outputs.get(index)
            if output is None:
                output = self._tool_outputs[index] = self.tools.output()
            delta = output.feed(text)
            if finish_reason is not None:
                last, finish_reason = output.finish(finish_reason)
                delta = _merge_deltas(delta, last)
            elif not delta and logprobs is None:
                return None
        return {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def first_chunks(self) -> list[dict]:
        """The role of each choice (with return_token_ids, the prompt's token ids too),
        then its echo."""
        chunks = []
        for index in range(self.num_choices):
            chunk = self._delta_chunk(index, {"role": "assistant", "content": ""})
            if self.return_token_ids:
                chunk["prompt_token_ids"] = self.prompt_token_ids
            chunks.append(chunk)
            if self.echo:
                chunks.append(self._delta_chunk(index, {"content": self.echo}))
        return chunks

    def _delta_chunk(self, index: int, delta: dict) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object_name, [choice])

    def _logprobs(self, entries: list[Logprobs]) -> dict:
        """Each sampled token, with the top_logprobs most likely tokens at its position."""
        content = []
        for entry in entries:
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)
            top = [self._logprob(t, lp) for t, lp in ranked[: self.top_logprobs]]
            content.append({**self._logprob(*next(iter(entry.items()))), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _logprob(self, token_id: int, logprob: Logprob) -> dict:
        token = self._logprob_token(token_id, logprob)
        return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode())}


def _merge_deltas(first: dict, second: dict) -> dict:
    """One delta of two: contents joined, tool-call pieces listed."""
    merged = {**first, **second}
    if "content" in first and "content" in second:
        merged["content"] = first["content"] + second["content"]
    if "tool_calls" in first and "tool_calls" in second:
        merged["tool_calls"] = first["tool_calls"] + second["tool_calls"]
    return merged
