"""A request's structured output fields as one StructuredOutputsParams, checked here so that a
malformed schema, regex or grammar is a 400 naming the field the client used.

OpenAI's `response_format` (json_object, json_schema; text asks for nothing), vLLM's
`guided_json` (a schema object or its JSON text), `guided_regex`, `guided_choice`,
`guided_grammar` (Lark or GBNF) and `structured_outputs`; at most one per request.
"""

from __future__ import annotations

import json

from ipc.grammar import grammar_error
from ipc.sampling_params import StructuredOutputsParams
from server.protocol import APIError, ResponseFormat, SamplingFields, StructuredOutputs

STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def structured_outputs_params(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's structured output, checked, or None when it asks for none."""
    given = [
        name
        for name in STRUCTURED_FIELDS
        if getattr(request, name) is not None
        and not (name == "response_format" and request.response_format.type == "text")
    ]
    if not given:
        return None
    if len(given) > 1:
        first, second = given[:2]
        message = f"only one structured output field may be given, got `{first}` and `{second}`"
        raise APIError(400, message, second)
    field = given[0]
    params = _params(field, getattr(request, field))
    check_structured_outputs(params, field)
    return params


def check_structured_outputs(params: StructuredOutputsParams, param: str) -> None:
    """A 400 naming `param` when llguidance cannot run the grammar `params` describe."""
    error = grammar_error(params)
    if error is not None:
        raise APIError(400, f"invalid `{param}` ({params.kind}): {error}", param)


def _params(field: str, value) -> StructuredOutputsParams:
    try:
        if field == "response_format":
            return _from_response_format(value)
        if field == "structured_outputs":
            return _from_structured_outputs(value)
        kind = field.removeprefix("guided_")
        return StructuredOutputsParams(**{kind: _as_text(value) if kind == "json" else value})
    except ValueError as e:
        raise APIError(400, f"invalid `{field}`: {e}", field) from None


def _from_response_format(value: ResponseFormat) -> StructuredOutputsParams:
    if value.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if value.json_schema is None or value.json_schema.schema_ is None:
        raise ValueError('type "json_schema" needs json_schema.schema')
    return StructuredOutputsParams(json=json.dumps(value.json_schema.schema_))


def _from_structured_outputs(value: StructuredOutputs) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=None if value.json_ is None else _as_text(value.json_),
        regex=value.regex,
        choice=value.choice,
        grammar=value.grammar,
        json_object=bool(value.json_object),
        disable_any_whitespace=bool(value.disable_any_whitespace),
    )


def _as_text(schema: dict | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)
