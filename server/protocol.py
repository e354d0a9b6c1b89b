"""The OpenAI request bodies the server accepts, and its error type.

Fields are strict (a string where a number belongs is a 400, not a coercion); fields
OpenAI defines that splitserve does not use are ignored, as OpenAI ignores unknown ones.
`ignore_eos`, `min_tokens`, `top_k`, `min_p`, `stop_token_ids`, `skip_special_tokens`,
`repetition_penalty` and `allowed_token_ids` are the extra sampling fields vLLM accepts,
and `cache_salt` keeps a request's prefix-cache blocks apart from those of requests
without the same salt.

Every integer fits in an int64, every float is finite (JSON's 1e309 parses as inf) and
every string is valid Unicode (JSON's "\\ud800" parses as a lone surrogate, which no
tokenizer or encoder takes): anything else is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_CACHE_SALT_CHARS = 256


def _valid_unicode(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the string holds a lone surrogate (not valid Unicode)") from None
    return text


Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, AfterValidator(_valid_unicode)]
Role = Literal["system", "user", "assistant", "tool", "developer"]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        if self.status == 503:
            kind = "service_unavailable"
        else:
            kind = "invalid_request_error" if self.status < 500 else "server_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False


class SamplingFields(_Body):
    """Fields common to both endpoints. None means "the default"."""

    model: Text | None = None
    n: Int64 | None = 1
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Int64 | None = None
    min_p: Finite | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = False
    min_tokens: Int64 | None = 0
    skip_special_tokens: bool | None = True
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    # Token ids as strings, as JSON object keys are (inputs.py makes them ints).
    logit_bias: dict[Text, Finite] | None = None
    allowed_token_ids: list[Int64] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[Text, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Text | list[Int64] | list[Text] | list[list[Int64]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None


class ContentPart(_Body):
    type: Text
    text: Text | None = None


class ChatMessage(_Body):
    role: Role
    content: Text | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
