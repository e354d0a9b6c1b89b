"""From StructuredOutputsParams to an llguidance grammar: shared by the server, which
checks a request's grammar before sending it, and the EngineCore, which compiles it.
llguidance is imported on first use only (a client or an engine that never sees a
structured request never loads it)."""

from __future__ import annotations

import json

from ipc.sampling_params import StructuredOutputsParams

ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for `params`; raises ValueError saying what
    is wrong when the spec does not even convert (not JSON, a GBNF rule missing)."""
    from llguidance import LLMatcher, grammar_from

    if params.json_object or params.json is not None:
        text = ANY_JSON_OBJECT if params.json_object else params.json
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if params.regex is not None:
        return grammar_from("regex", params.regex)
    if params.choice is not None:
        return grammar_from("choice", json.dumps(params.choice))
    return grammar_from("grammar", params.grammar)


def grammar_error(params: StructuredOutputsParams) -> str | None:
    """Why `params` is not a grammar llguidance can run, or None (checked without a
    tokenizer: what a grammar says, not which tokens spell it)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(grammar_of(params)) or None
    except ValueError as e:
        return str(e)
