"""From an OpenAI request body to what the engine takes: prompt token ids and SamplingParams.

The prompt functions tokenize (the app runs them off its event loop); a text prompt whose
length in bytes already shows it cannot fit is refused without being tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ipc.kv_transfer import KVTransferParams
from ipc.sampling_params import SamplingParams
from ipc.tokenizer import Message, TokenizerLike
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from server.structured_output import structured_outputs_params
from server.tools import ToolChoice, template_inputs

T = TypeVar("T")
MAX_BATCHED_SEQUENCES = 4096  # of a batch of prompts: prompts × choices (n or best_of)


@dataclass(frozen=True)
class PromptLimits:
    """What a request must fit (None: unchecked); `min_num_tokens(text)` bounds a text's
    token count from below without tokenizing it."""

    max_model_len: int | None = None
    vocab_size: int | None = None
    min_num_tokens: Callable[[str], int] | None = None

    def too_long(self, text: str) -> bool:
        """Whether `text` surely encodes to max_model_len tokens or more (and so leaves no
        room to generate)."""
        if self.max_model_len is None or self.min_num_tokens is None:
            return False
        return self.min_num_tokens(text) >= self.max_model_len

    def check_text(self, text: str, param: str) -> None:
        if self.too_long(text):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt ({len(text.encode())} bytes) has more: no room to generate. Please "
                "shorten the prompt.",
                param,
                "context_length_exceeded",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if min(token_ids) < 0:
            raise APIError(400, f"{param}: token ids must be >= 0", param)
        if self.vocab_size is not None and max(token_ids) >= self.vocab_size:
            message = f"{param}: token ids must be below the vocabulary size {self.vocab_size}"
            raise APIError(400, message, param)


def completion_prompts(
    request: CompletionRequest, tokenizer: TokenizerLike, limits: PromptLimits
) -> list[list[int]]:
    """Each prompt's token ids: `prompt` is a text, token ids, or a batch of either (each
    prompt of a batch its own engine request, as in vLLM)."""
    prompt = request.prompt
    batch = prompt if _is_batch(prompt) else [prompt]
    choices = max(request.n or 1, request.best_of or 1)  # n alone is checked with the rest
    if len(batch) > 1 and len(batch) * choices > MAX_BATCHED_SEQUENCES:
        message = (
            f"a request runs at most {MAX_BATCHED_SEQUENCES} sequences (prompts × n or "
            f"best_of), got {len(batch)} × {choices}"
        )
        raise APIError(400, message, "prompt")
    keep = _truncation(request, limits)
    return [_prompt_ids(one, request, keep, tokenizer, limits) for one in batch]


def _is_batch(prompt: str | list) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


def _prompt_ids(
    prompt: str | list[int],
    request: CompletionRequest,
    keep: int | None,
    tokenizer: TokenizerLike,
    limits: PromptLimits,
) -> list[int]:
    if isinstance(prompt, str):
        if keep is None:
            limits.check_text(prompt, "prompt")
        token_ids = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
    else:
        token_ids = prompt
    token_ids = token_ids if keep is None else token_ids[-keep:]
    if not token_ids:
        raise APIError(400, "the prompt is empty", "prompt")
    limits.check_token_ids(token_ids, "prompt")
    return token_ids


def chat_prompt_ids(
    request: ChatCompletionRequest,
    tokenizer: TokenizerLike,
    limits: PromptLimits,
    tools: ToolChoice | None = None,
    tool_parser: str | None = None,
) -> list[int]:
    """The prompt of a chat request; `tools` and `tool_parser` as server/tools.py takes them."""
    messages, template_tools = template_inputs(
        chat_messages(request.messages), tools, tokenizer, tool_parser
    )
    options = (request.add_generation_prompt, request.continue_final_message)
    keep = _truncation(request, limits)
    if keep is None:
        return chat_ids(messages, *options, tokenizer, limits, template_tools)
    unbounded = PromptLimits()  # the prompt is cut to fit instead
    return chat_ids(messages, *options, tokenizer, unbounded, template_tools)[-keep:]


def _truncation(request: CompletionRequest | ChatCompletionRequest, limits: PromptLimits):
    """How many prompt tokens `truncate_prompt_tokens` keeps (the last ones; -1: the
    context length), or None."""
    keep = request.truncate_prompt_tokens
    if keep == -1:
        keep = limits.max_model_len
    if keep is None:
        return None
    if keep < 1 or (limits.max_model_len is not None and keep > limits.max_model_len):
        message = f"truncate_prompt_tokens must be -1 or in [1, max_model_len], got {keep}"
        raise APIError(400, message, "truncate_prompt_tokens")
    return keep


def chat_ids(
    messages: list[Message],
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
    tokenizer: TokenizerLike,
    limits: PromptLimits,
    tools: list[dict] | None = None,
) -> list[int]:
    """The chat template applied to `messages` (and `tools`, for a template that reads
    them); `continue_final_message` leaves the final message open (a 400 with
    `add_generation_prompt`, as in vLLM)."""
    generation_prompt = add_generation_prompt is not False
    if continue_final_message and generation_prompt:
        message = "`continue_final_message` needs `add_generation_prompt: false`"
        raise APIError(400, message, "continue_final_message")
    options = (generation_prompt, tools, bool(continue_final_message))
    if limits.too_long("".join(m["content"] for m in messages) + json.dumps(tools or "")):
        # A template may leave messages out: the prompt it renders is what must fit.
        text = _by_template(lambda: tokenizer.apply_chat_template(messages, *options))
        limits.check_text(text, "messages")
    return _by_template(lambda: tokenizer.encode_chat(messages, *options))


def _by_template(render: Callable[[], T]) -> T:
    try:
        return render()
    except Exception as e:  # a template may raise anything (jinja's raise_exception among them)
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from e


def chat_echo(request: ChatCompletionRequest) -> str:
    """What `echo` puts before each choice's content: the final message's content when
    the assistant wrote it (as in vLLM), else nothing."""
    if not request.echo or request.messages[-1].role != "assistant":
        return ""
    return _message(request.messages[-1])["content"]


def chat_messages(chat: list[ChatMessage]) -> list[Message]:
    return [_message(m) for m in chat]


def _message(message: ChatMessage) -> Message:
    """A message as chat templates take it: text content; a `name`, a `tool_call_id` and
    earlier `tool_calls` (arguments as JSON values, as transformers' templates expect)
    when given."""
    content = message.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:  # the protocol takes text parts only
        text = "".join(part.text or "" for part in content)
    out: Message = {"role": message.role, "content": text}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [_template_call(call.model_dump()) for call in message.tool_calls]
    return out


def _template_call(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        arguments = call["function"]["arguments"]
    return {**call, "function": {**call["function"], "arguments": arguments}}


def echo_texts(
    request: CompletionRequest, prompts: list[list[int]], tokenizer: TokenizerLike
) -> list[str]:
    """Each prompt as `echo` puts it before its completions: as sent, or decoded (token
    ids, or a truncated prompt)."""
    sent = request.prompt if _is_batch(request.prompt) else [request.prompt]
    return [
        text
        if isinstance(text, str) and request.truncate_prompt_tokens is None
        else tokenizer.decode(token_ids, skip_special_tokens=False)
        for text, token_ids in zip(sent, prompts, strict=True)
    ]


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_tokens: int | None,
    logprobs: int | None,
    limits: PromptLimits,
    defaults: dict | None = None,
) -> SamplingParams:
    """SamplingParams for a request, over `defaults` (the model's generation config); every
    invalid value is an APIError(400) naming the field."""
    for name in ("stop_token_ids", "allowed_token_ids"):
        if getattr(request, name):
            limits.check_token_ids(getattr(request, name), name)
    given = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "min_tokens": request.min_tokens,
        "stop": [request.stop] if isinstance(request.stop, str) else request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": _logit_bias(request.logit_bias, limits),
        "allowed_token_ids": request.allowed_token_ids,
        "bad_words": request.bad_words,
        "prompt_logprobs": _prompt_logprobs(request, logprobs),
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "structured_outputs": structured_outputs_params(request),
        "kv_transfer_params": _kv_transfer_params(request),
    }
    kwargs = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
    if request.stream and (request.best_of or 1) > (request.n or 1):
        message = "best_of must equal n when streaming (the n best are known only at the end)"
        raise APIError(400, message, "best_of")
    try:
        return SamplingParams(
            n=1 if request.n is None else request.n,
            best_of=request.best_of,
            seed=request.seed,
            logprobs=logprobs,
            max_tokens=_max_tokens(max_tokens, num_prompt_tokens, limits.max_model_len),
            **kwargs,
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        param = field if field in SamplingParams.__struct_fields__ else None
        if param == "logprobs" and isinstance(request, ChatCompletionRequest):
            param = "top_logprobs"  # chat's count of logprobs
        raise APIError(400, str(e), param) from None


def _kv_transfer_params(request: SamplingFields) -> KVTransferParams | None:
    if request.kv_transfer_params is None:
        return None
    try:
        json.dumps(request.kv_transfer_params, ensure_ascii=False).encode()
        return KVTransferParams.from_dict(request.kv_transfer_params)
    except (ValueError, UnicodeEncodeError) as e:
        raise APIError(400, f"kv_transfer_params: {e}", "kv_transfer_params") from None


def _prompt_logprobs(request: CompletionRequest | ChatCompletionRequest, logprobs: int | None):
    """As asked; `echo` with `logprobs` asks for the echoed prompt's logprobs too (vLLM)."""
    if request.prompt_logprobs is None and getattr(request, "echo", False):
        return logprobs
    return request.prompt_logprobs


def _logit_bias(bias: dict[str, float] | None, limits: PromptLimits) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with int keys; a key that is not a token id is a 400."""
    if not bias:
        return None
    if not all(key.isascii() and key.isdigit() and len(key) <= 18 for key in bias):
        raise APIError(400, "logit_bias keys must be token ids (decimal integers)", "logit_bias")
    by_id = {int(key): value for key, value in bias.items()}
    limits.check_token_ids(list(by_id), "logit_bias")
    return by_id


def _max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int | None):
    """None means "up to the context length"; a request that cannot fit is a 400."""
    if max_model_len is None:
        return requested
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
            f"{num_prompt_tokens} tokens: no room to generate. Please shorten the prompt.",
            "prompt",
            "context_length_exceeded",
        )
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
            f"{requested} for the completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested
