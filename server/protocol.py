"""The OpenAI request bodies the server accepts, and its error type.

Every field of OpenAI's and vLLM's request schemas is either honoured or refused with a
400 naming it; unknown fields are refused too. Fields are strict (a string where a
number belongs is a 400, not a coercion). vLLM's extra fields are honoured: `ignore_eos`,
`min_tokens`, `top_k`, `min_p`, `stop_token_ids`, `skip_special_tokens`,
`repetition_penalty`, `allowed_token_ids`, `bad_words`, `prompt_logprobs` (not with
`stream`: a 400), `include_stop_str_in_output`, `priority`, `request_id`,
`truncate_prompt_tokens`, `stream_options.continuous_usage_stats` (only with `stream`, as
in vLLM), `return_token_ids`, `return_tokens_as_token_ids`; a completions `prompt` may be a
batch (a list of texts or of token id lists), its choices numbered prompt by prompt; chat's
`continue_final_message` (not with `add_generation_prompt`) and `echo`;
`kv_transfer_params` (vLLM's prefill/decode disaggregation; with one prompt and n = 1);
structured output: OpenAI's `response_format` (json_object, json_schema) and vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`
(one of them per request; server/structured_output.py); `cache_salt` keeps a request's
prefix-cache blocks apart from those of requests without the same salt. `n` (up to
ipc.sampling_params.MAX_N choices) and `best_of` (the n of best_of candidates with the highest
cumulative logprob; not with `stream`) are honoured on both endpoints. `user`,
`metadata`, `safety_identifier` and `prompt_cache_key` are accepted: they describe the
request and change nothing in it.

Refused unless given the value that asks for nothing (null always does; see NO_OP_VALUES):
both endpoints: beam search (`use_beam_search`, `length_penalty`), `structural_tag`, the
choice of a structured output backend or whitespace (`guided_decoding_backend`,
`guided_whitespace_pattern`: llguidance is the one backend), `logits_processors`,
`spaces_between_special_tokens: false`, `vllm_xargs`; completions:
`suffix`, `prompt_embeds`; chat: the deprecated `functions` and `function_call` (tools
are honoured, see server/tools.py), `add_special_tokens`, `chat_template`,
`chat_template_kwargs`, `documents`, multimodal input (`modalities` other than text,
`audio`, non-text content parts, `mm_processor_kwargs`, `media_io_kwargs`),
`reasoning_effort`, `verbosity`, `include_reasoning: false`, `prediction`,
`web_search_options`, `store`, `service_tier` other than auto/default.

Every integer fits in an int64, every float is finite (JSON's 1e309 parses as inf) and
every string is valid Unicode (JSON's "\\ud800" parses as a lone surrogate, which no
tokenizer or encoder takes): anything else is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_CACHE_SALT_CHARS = 256
UNSUPPORTED = "unsupported"  # the pydantic error type of a refused field


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


def _same(value: Any, no_op: Any) -> bool:
    """Equal and of the same type (JSON's true is not 1)."""
    return type(value) is type(no_op) and value == no_op


class RequestBody(BaseModel):
    """Unknown fields are refused; a field of NO_OP_VALUES is dropped when its value asks
    for nothing (None, or one of the values listed), and refused otherwise."""

    model_config = ConfigDict(extra="forbid", strict=True)
    NO_OP_VALUES: ClassVar[dict[str, tuple]] = {}
    MESSAGES: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in cls.NO_OP_VALUES.keys() & data.keys():
            value = data[name]
            if value is not None and not any(_same(value, ok) for ok in cls.NO_OP_VALUES[name]):
                message = cls.MESSAGES.get(name, "`{field}` is not supported by this server")
                raise PydanticCustomError(UNSUPPORTED, message, {"field": name})
        return {key: value for key, value in data.items() if key not in cls.NO_OP_VALUES}


class StreamOptions(RequestBody):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk
    include_obfuscation: bool | None = None  # nothing is obfuscated


JsonSchema = dict[Text, Any]
Choices = Annotated[list[Text], Field(min_length=1)]


class JsonSchemaFormat(RequestBody):
    """OpenAI's response_format.json_schema; `strict` or not, the schema is enforced."""

    name: Text
    description: Text | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestBody):
    """vLLM's structured_outputs object: one of json, regex, choice, grammar, json_object.
    `disable_fallback` changes nothing (llguidance is the one backend, never a fallback)."""

    NO_OP_VALUES = {
        "disable_fallback": (False, True),
        "disable_additional_properties": (False,),
        "whitespace_pattern": (),
        "structural_tag": (),
    }

    json_: JsonSchema | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = False


class SamplingFields(RequestBody):
    """Fields common to both endpoints. None means "the default"."""

    NO_OP_VALUES = {
        "use_beam_search": (False,),
        "length_penalty": (1.0, 1),
        "structural_tag": (),
        "guided_decoding_backend": (),
        "guided_whitespace_pattern": (),
        "logits_processors": ([],),
        "spaces_between_special_tokens": (True,),
        "vllm_xargs": (),
    }
    model: Text | None = None
    user: Text | None = None
    request_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    n: Int64 | None = None
    best_of: Int64 | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Int64 | None = None
    min_p: Finite | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool | None = False
    ignore_eos: bool | None = False
    min_tokens: Int64 | None = 0
    skip_special_tokens: bool | None = True
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    # Token ids as strings, as JSON object keys are (inputs.py makes them ints).
    logit_bias: dict[Text, Finite] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[Text] | None = None
    prompt_logprobs: Int64 | None = None  # not with stream (as vLLM)
    priority: Int64 | None = 0
    truncate_prompt_tokens: Int64 | None = None  # keep the last ones; -1: max_model_len
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[Text, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    return_token_ids: bool | None = False  # the prompt's and each choice's token ids
    return_tokens_as_token_ids: bool | None = False  # logprobs name tokens "token_id:<id>"
    # Prefill/decode disaggregation (ipc/kv_transfer.py; checked by inputs.py).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    NO_OP_VALUES = {**SamplingFields.NO_OP_VALUES, "suffix": ("",), "prompt_embeds": ()}

    prompt: Text | list[Int64] | list[Text] | list[list[Int64]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True


class ContentPart(RequestBody):
    type: Text
    text: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            message = "content parts of type `{kind}` are not supported (text only)"
            raise PydanticCustomError(UNSUPPORTED, message, {"kind": str(data.get("type"))})
        return data


class FunctionCall(RequestBody):
    name: Text
    arguments: Text  # JSON text


class ToolCallMessage(RequestBody):
    """A call an assistant made earlier in the conversation."""

    id: Text
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(RequestBody):
    name: Annotated[Text, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[Text, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestBody):
    name: Text


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(RequestBody):
    NO_OP_VALUES = {"function_call": (), "audio": (), "refusal": ()}

    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None  # passed to the chat template
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: Text | None = None


class ChatCompletionRequest(SamplingFields):
    NO_OP_VALUES = {
        **SamplingFields.NO_OP_VALUES,
        "functions": ([],),
        "function_call": ("none", "auto"),
        "add_special_tokens": (False,),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "documents": (),
        "modalities": (["text"],),
        "audio": (),
        "mm_processor_kwargs": (),
        "media_io_kwargs": (),
        "reasoning_effort": (),
        "include_reasoning": (True,),  # no reasoning parser: the text is all there is
        "verbosity": (),
        "prediction": (),
        "web_search_options": (),
        "store": (False,),
        "service_tier": ("auto", "default"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False  # the model goes on with the final message
    echo: bool | None = False  # the final message's content leads each choice's, if assistant
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    metadata: dict[Text, Text] | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
