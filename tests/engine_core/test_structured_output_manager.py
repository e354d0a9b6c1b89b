"""Structured output in the EngineCore: the bitmask rows it sends, the tokens it accepts,
its grammar cache, its errors, and the matcher's life (stand-in workers, the tiny
byte-level tokenizer: token id == byte, EOS 258). The stand-in ignores the bitmask, so
its scripts play the model; each row is read back bit by bit."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from stand_in_executor import make_engine, run_to_completion

from engine_core.structured_output import GRAMMAR_REJECTED
from ipc.messages import EngineCoreRequest, ErrorCode, FinishReason
from ipc.sampling_params import SamplingParams, StructuredOutputsParams
from tests.models.tiny import EOS_ID, make_tiny_tokenizer

VOCAB_SIZE = 288
DIGITS = set(b"0123456789")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tiny_tokenizer(path)
    return str(path)


def engine_for(tokenizer: str, script=None, **config):
    settings = dict(tokenizer=tokenizer, vocab_size=VOCAB_SIZE, eos_token_ids=[EOS_ID])
    return make_engine(script=script, **{**settings, **config})


def request(request_id: str, prompt_len: int = 4, **sampling) -> EngineCoreRequest:
    kinds = ("json", "regex", "choice", "grammar", "json_object")
    spec = {k: sampling.pop(k) for k in kinds if k in sampling}
    structured = StructuredOutputsParams(**spec) if spec else None
    params = SamplingParams(**{"max_tokens": 8, **sampling}, structured_outputs=structured)
    return EngineCoreRequest(request_id, [65 + i % 26 for i in range(prompt_len)], params, 0.0)


def rows(so) -> dict[str, set[int]]:
    """Request id -> the token ids its bitmask row allows."""
    if not so.structured_output_request_ids:
        return {}
    words = np.frombuffer(so.grammar_bitmask, dtype="<i4").reshape(
        len(so.structured_output_request_ids), -1
    )
    return {
        request_id: {
            32 * w + j for w in range(words.shape[1]) for j in range(32) if words[k, w] >> j & 1
        }
        for k, request_id in enumerate(so.structured_output_request_ids)
    }


def test_rows_go_only_to_structured_requests_that_sample(tokenizer):
    engine, executor = engine_for(
        tokenizer, {"S": list(b"12") + [EOS_ID]}, max_num_batched_tokens=8
    )
    engine.add_request(request("S", 20, regex="[0-9]+"))
    engine.add_request(request("P", 3, max_tokens=4))
    results = run_to_completion(engine)
    assert results["S"] == [[*b"12", EOS_ID], "stop"]
    sent = [rows(so) for so in executor.outputs]
    samples = [so.num_scheduled_tokens.get("S") for so in executor.outputs]
    # 20 prompt tokens in chunks of 8: rows once the last chunk runs, then at each decode.
    assert samples[:3] == [8, 8, 4]
    assert sent[0] == sent[1] == {}
    assert sent[2] == {"S": DIGITS}  # the regex needs a digit before it may end
    assert sent[3] == {"S": DIGITS | {EOS_ID}}
    assert sent[4] == {"S": DIGITS | {EOS_ID}}
    assert all(so.structured_output_request_ids == [] for so in executor.outputs[5:])
    assert results["P"][1] == "length"


def test_a_complete_grammar_allows_only_eos_which_ends_it_even_under_ignore_eos(tokenizer):
    script = list(b"ab") + [EOS_ID, *b"zz"]
    for ignore_eos in (False, True):
        engine, executor = engine_for(tokenizer, {"R": script})
        engine.add_request(request("R", regex="ab", ignore_eos=ignore_eos))
        assert run_to_completion(engine) == {"R": [[*b"ab", EOS_ID], "stop"]}
        assert [rows(so) for so in executor.outputs] == [
            {"R": {ord("a")}},
            {"R": {ord("b")}},
            {"R": {EOS_ID}},
        ]


def test_a_token_off_the_grammar_fails_the_request(tokenizer):
    engine, _ = engine_for(tokenizer, {"R": list(b"ax")})
    engine.add_request(request("R", choice=["ab", "cd"]))
    engine.step()
    out = engine.step().outputs[0]
    assert (out.finish_reason, out.error, out.error_code) == (
        FinishReason.ERROR,
        GRAMMAR_REJECTED,
        ErrorCode.INTERNAL,
    )
    assert engine.scheduler.structured_output.matchers == {}


def test_each_spec_is_compiled_once(tokenizer):
    engine, _ = engine_for(tokenizer)
    manager = engine.scheduler.structured_output
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    for i in range(3):
        engine.add_request(request(f"J{i}", json=schema))
        engine.add_request(request(f"C{i}", choice=["x", "y"]))
    assert manager.num_compiled == 2
    engine.add_request(request("J3", json=schema.replace("integer", "boolean")))
    engine.add_request(request("C3", choice=["x", "y"], json_object=False))
    assert manager.num_compiled == 3
    assert len(manager.matchers) == 8
    # Requests of one spec do not share a matcher: each follows its own tokens.
    assert len({id(m) for m in manager.matchers.values()}) == 8


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"json": '{"type": "foo"}'}, "foo"),
        ({"json": '{"type": "object", "properties": 3}'}, "properties"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1]"}, "must be a JSON object"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "root ::= missing"}, "missing"),
        ({"grammar": "start: ("}, "start"),
    ],
)
def test_an_invalid_spec_fails_its_request_naming_the_problem(tokenizer, spec, problem):
    engine, _ = engine_for(tokenizer)
    engine.add_request(request("bad", **spec))
    engine.add_request(request("good", max_tokens=2))
    bad = next(o for o in engine.step().outputs if o.request_id == "bad")
    assert bad.finish_reason == FinishReason.ERROR
    assert bad.error_code == ErrorCode.INVALID_REQUEST
    kind = next(iter(spec))
    assert f"structured_outputs.{kind} is invalid" in bad.error
    assert problem in bad.error
    assert run_to_completion(engine)["good"][1] == "length"  # the engine serves the others


def test_structured_output_without_a_tokenizer_json_is_refused(tmp_path):
    engine, _ = make_engine(tokenizer=str(tmp_path), vocab_size=VOCAB_SIZE)
    engine.add_request(request("R", regex="a"))
    out = engine.step().outputs[0]
    assert out.finish_reason == FinishReason.ERROR and "tokenizer.json" in out.error


def test_matchers_are_freed_on_finish_and_abort(tokenizer):
    script = {"A": [*b"ab", EOS_ID], "B": [ord("x")] * 50, "C": [ord("x")] * 50}
    engine, _ = engine_for(tokenizer, script)
    engine.add_request(request("A", regex="ab"))
    engine.add_request(request("B", regex="[a-z]+", max_tokens=50))
    engine.add_request(request("C", regex="[a-z]+", max_tokens=50))
    manager = engine.scheduler.structured_output
    for _ in range(4):
        engine.step()
    assert set(manager.matchers) == {"B", "C"}
    engine.abort_requests(["B"])
    assert set(manager.matchers) == {"C"}
    engine.abort_requests(["C"])
    run_to_completion(engine)
    assert manager.matchers == {}


def test_preemption_keeps_what_the_matcher_accepted(tokenizer):
    """A preempted request recomputes its tokens; its matcher is not replayed or reset, so
    the grammar goes on from where it was (a reset would reject the next letter)."""
    word = b"abcdefghijklmnopqrstuvwxyz"
    script = {"S": [*word[:20], EOS_ID], "P": [ord("x")] * 30}
    # 12 usable blocks of 4 tokens: not enough for both to finish side by side.
    engine, _ = engine_for(tokenizer, script, num_blocks=13, max_model_len=48, block_size=4)
    engine.add_request(request("P", 8, max_tokens=30, ignore_eos=True))
    engine.add_request(request("S", 8, regex="abcdefghijklmnopqrst", max_tokens=30))
    results = run_to_completion(engine)
    assert engine.get_stats().num_preemptions > 0
    assert results["S"] == [[*word[:20], EOS_ID], "stop"]
    assert results["P"][1] == "length"


def test_the_engine_core_never_imports_torch_for_structured_output(tokenizer):
    code = f"""
import sys
sys.path.insert(0, "tests/engine_core")
from stand_in_executor import make_engine, run_to_completion
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams, StructuredOutputsParams
engine, _ = make_engine(
    script={{"R": [97, 98, 258]}}, tokenizer={tokenizer!r}, vocab_size=288, eos_token_ids=[258]
)
params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab"))
engine.add_request(EngineCoreRequest("R", [1, 2], params, 0.0))
assert run_to_completion(engine) == {{"R": [[97, 98, 258], "stop"]}}
assert "llguidance" in sys.modules
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True
    )
    assert result.stdout.strip() == "[]"


def test_an_engine_without_structured_requests_loads_and_sends_nothing_for_them():
    code = """
import sys
sys.path.insert(0, "tests/engine_core")
from stand_in_executor import make_engine, make_request, run_to_completion
engine, executor = make_engine()
engine.add_request(make_request("R", 6, max_tokens=3))
run_to_completion(engine)
assert executor.outputs
assert all(
    (so.structured_output_request_ids, so.grammar_bitmask) == ([], b"") for so in executor.outputs
)
print("llguidance" in sys.modules)
"""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True
    )
    assert result.stdout.strip() == "False"
