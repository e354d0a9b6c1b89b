"""Structured output end to end on a tiny random Llama (in-process engine, fp32): each
output is checked by an independent judge (jsonschema, re.fullmatch, membership), under
chunked prefill, preemption and prefix hits; requests without a grammar are untouched.

A random model follows no grammar of its own, so the schemas bound their outputs (enums,
integers with bounds, booleans, short strings) and JSON is asked for without free
whitespace (vLLM's disable_any_whitespace), which a random model would repeat forever."""

import json
import re

import jsonschema
import pytest

from splitserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "member", "color"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe"]
GBNF = 'root ::= "go " dir\ndir ::= "north" | "south" | "east" | "west"'
LARK = 'start: "go " DIR\nDIR: "up" | "down"'
PROMPTS = ["abc", "hello there", "{", "xyz 123", "The answer is"]


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)


def params(temperature: float = 0.0, max_tokens: int = 120, **spec) -> SamplingParams:
    structured = StructuredOutputsParams(**spec)
    return SamplingParams(
        temperature=temperature, seed=7, max_tokens=max_tokens, structured_outputs=structured
    )


def json_params(**kw) -> SamplingParams:
    return params(json=json.dumps(SCHEMA), disable_any_whitespace=True, **kw)


def texts(llm: LLM, prompts: list, sampling) -> list[str]:
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * len(prompts)
    return [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm, temperature):
    for text in texts(llm, PROMPTS, json_params(temperature=temperature)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_schema_object_is_taken_as_its_json_text(llm):
    (text,) = texts(llm, ["abc"], params(json=SCHEMA, disable_any_whitespace=True))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_composes_with_logit_bias(llm):
    """Any JSON object; a bias towards "}" (applied after the grammar's mask) closes it."""
    sampling = params(json_object=True)
    biased = SamplingParams(**{**_fields(sampling), "logit_bias": {ord("}"): 100.0}})
    assert texts(llm, PROMPTS[:2], biased) == ["{}", "{}"]


def test_regex_choice_and_grammars(llm):
    for text in texts(llm, PROMPTS, params(regex=REGEX, temperature=1.0)):
        assert re.fullmatch(REGEX, text), text
    for text in texts(llm, PROMPTS, params(choice=CHOICES, temperature=1.0)):
        assert text in CHOICES
    for text in texts(llm, PROMPTS, params(grammar=GBNF, temperature=1.0)):
        assert re.fullmatch("go (north|south|east|west)", text), text
    for text in texts(llm, PROMPTS, params(grammar=LARK, temperature=1.0)):
        assert text in ("go up", "go down")


def test_an_invalid_schema_fails_only_its_request(llm):
    bad = params(json='{"type": "object", "properties": {"a": {"type": "nope"}}}')
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out_bad, out_good = llm.generate(["abc", "abc"], [bad, good], use_tqdm=False)
    assert out_bad.outputs[0].finish_reason == "error"
    assert "structured_outputs.json is invalid" in out_bad.error and "nope" in out_bad.error
    assert len(out_good.outputs[0].token_ids) == 4


def test_unconstrained_requests_keep_their_greedy_tokens_beside_structured_ones(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    mixed_params = [plain, json_params(), plain, params(regex=REGEX), plain]
    mixed = llm.generate(PROMPTS, mixed_params, use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == [alone[i] for i in (0, 2, 4)]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)
    assert re.fullmatch(REGEX, mixed[3].outputs[0].text)


def test_chunked_prefill_preemption_and_prefix_hits(checkpoint):
    """Long prompts prefilled in chunks of 16, a KV cache too small for the batch (so
    requests are preempted and recomputed mid-grammar), then the same prompts again (prefix
    hits): every output still validates, and the greedy ones repeat exactly."""
    llm = LLM(
        checkpoint,
        dtype="float32",
        max_model_len=256,
        block_size=8,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=40,
    )
    prompts = [f"{p} " * 6 for p in PROMPTS]
    sampling = [json_params(), params(regex=REGEX), json_params(), params(choice=CHOICES)] * 2
    sampling += [json_params()] * (len(prompts) * 2 - len(sampling))
    batch = prompts + prompts[::-1]
    first = llm.generate(batch, sampling, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    again = llm.generate(batch, sampling, use_tqdm=False)
    assert sum(o.num_cached_tokens > 0 for o in again) >= len(batch) // 2
    for outputs in (first, again):
        for out, sp in zip(outputs, sampling, strict=True):
            text = out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop", text
            spec = sp.structured_outputs
            if spec.json is not None:
                jsonschema.validate(json.loads(text), SCHEMA)
            elif spec.regex is not None:
                assert re.fullmatch(REGEX, text)
            else:
                assert text in CHOICES
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def _fields(sampling: SamplingParams) -> dict:
    return {name: getattr(sampling, name) for name in sampling.__struct_fields__}
