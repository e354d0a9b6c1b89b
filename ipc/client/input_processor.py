"""A prompt and its sampling params to the EngineCoreRequest that runs them, as the
clients and LLM send it: the params checked against the tokenizer (bad words to token
ids, stop strings), the prompt encoded (text, token ids, vLLM's prompt dicts, chats)."""

from __future__ import annotations

import os
import time
from typing import TypedDict

from ipc.bad_words import with_bad_words_token_ids
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams
from ipc.tokenizer import Message, Tokenizer, TokenizerLike


class TextPrompt(TypedDict):
    """vLLM's prompt dict of a text."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's prompt dict of token ids."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt


def load_tokenizer(tokenizer: str | os.PathLike | TokenizerLike | None) -> TokenizerLike | None:
    if isinstance(tokenizer, str | os.PathLike):
        return Tokenizer.from_pretrained(tokenizer)
    return tokenizer


class InputProcessor:
    def __init__(self, tokenizer: TokenizerLike | None) -> None:
        self.tokenizer = tokenizer

    def process(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The request, and the prompt's text when it was given as text."""
        params = with_bad_words_token_ids(params, self.tokenizer)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        token_ids = self.prompt_token_ids(prompt)
        arrival = time.time()
        request = EngineCoreRequest(request_id, token_ids, params, arrival, priority, cache_salt)
        return request, prompt_text(prompt)

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            prompt = _prompt_of_dict(prompt)
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or a tokenizer")
        return self.tokenizer.encode(prompt)

    def chat_token_ids(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The chat template applied; message content is text (never special tokens)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        return self.tokenizer.encode_chat(
            messages, add_generation_prompt, continue_final_message=continue_final_message
        )


def prompt_text(prompt: Prompt) -> str | None:
    """The prompt's text, when it was given as text."""
    if isinstance(prompt, dict):
        prompt = _prompt_of_dict(prompt)
    return prompt if isinstance(prompt, str) else None


def _prompt_of_dict(prompt: dict) -> str | list[int]:
    """The text or token ids of a TextPrompt or TokensPrompt; anything else in the dict
    (vLLM's multimodal data, embeddings) is refused, not ignored."""
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    keys = ", ".join(sorted(map(str, prompt)))
    raise ValueError(
        f"a prompt dict holds either 'prompt' or 'prompt_token_ids' and nothing else, got {keys}"
    )
