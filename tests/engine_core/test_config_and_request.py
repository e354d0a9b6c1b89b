"""EngineConfig defaults, model-folder reading and validation; Request bookkeeping."""

import json

import msgspec
import pytest

import engine_core.request as request_module
from engine_core import EngineConfig, Request, RequestStatus, SamplingParams
from ipc.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    PromptLogprobs,
    TokenLogprobs,
    encode,
)
from kv_cache import block_hashes


def test_config_without_a_model_folder():
    config = EngineConfig(max_model_len=128)
    assert config.max_num_batched_tokens is None and config.eos_token_ids == []
    assert config.tokenizer is None and config.vocab_size is None
    no_chunking = EngineConfig(max_model_len=128, enable_chunked_prefill=False)
    assert no_chunking.max_num_batched_tokens == 128


def test_token_budget_defaults_by_device_unless_given():
    """Without --max-num-batched-tokens each side resolves the budget for its device;
    a given one (or max-model-len without chunked prefill) holds everywhere."""
    config = EngineConfig(max_model_len=128)
    assert config.token_budget("cpu") == 2048 and config.token_budget("cuda") == 8192
    given = EngineConfig(max_model_len=128, max_num_batched_tokens=300)
    assert given.token_budget("cpu") == given.token_budget("cuda") == 300
    no_chunking = EngineConfig(max_model_len=128, enable_chunked_prefill=False)
    assert no_chunking.token_budget("cpu") == no_chunking.token_budget("cuda") == 128


def test_config_reads_the_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 2048, "vocab_size": 320, "eos_token_id": 2})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = EngineConfig(model=str(tmp_path))
    assert (config.max_model_len, config.vocab_size, config.eos_token_ids) == (2048, 320, [2, 7])
    assert config.tokenizer == str(tmp_path)
    assert EngineConfig(model=str(tmp_path), max_model_len=512).max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len .* max_position_embeddings"):
        EngineConfig(model=str(tmp_path), max_model_len=4096)


def test_config_needs_a_model_folder_or_max_model_len(tmp_path):
    with pytest.raises(ValueError, match="max_model_len must be given"):
        EngineConfig()
    with pytest.raises(ValueError, match="config.json"):
        EngineConfig(model=str(tmp_path))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_model_len", 1),
        ("block_size", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("tensor_parallel_size", 0),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("kv_cache_memory", 0),
        ("num_gpu_blocks_override", 1),
        ("scheduling_policy", "lifo"),
        ("attention_backend", "xformers"),
        ("dtype", "int8"),
        ("device", "tpu"),
        ("vocab_size", 0),
        ("eos_token_ids", [-1]),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{"max_model_len": 128, field: value})


def test_config_without_chunking_needs_room_for_a_whole_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens .* chunked prefill"):
        EngineConfig(max_model_len=128, enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_finish_reasons_are_ints_on_the_wire_and_names_at_the_edge():
    out = EngineCoreOutput("r", [1], FinishReason.LENGTH)
    assert msgspec.msgpack.decode(encode(EngineCoreOutputs([out])))[1][0][2] == 1
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]


def test_request_status_finish_reasons():
    assert [s.is_finished for s in RequestStatus] == [False] * 4 + [True] * 4
    assert [s.finish_reason for s in RequestStatus] == [
        None,
        None,
        None,
        None,
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.ABORT,
        FinishReason.ERROR,
    ]


def test_request_from_engine_core_request():
    sp = SamplingParams(max_tokens=5, stop_token_ids=[9], ignore_eos=True)
    wire = EngineCoreRequest("r", [1, 2, 3], sp, 12.5, priority=3, cache_salt="s")
    request = Request.from_engine_core_request(wire, eos_token_ids=[2])
    assert (request.request_id, request.prompt_token_ids, request.arrival_time) == (
        "r",
        [1, 2, 3],
        12.5,
    )
    assert (request.priority, request.cache_salt, request.max_tokens) == (3, "s", 5)
    assert request.stop_token_ids == {9}  # ignore_eos leaves the EOS out
    assert (request.num_tokens, request.num_computed_tokens, request.status) == (
        3,
        0,
        RequestStatus.WAITING,
    )


def test_block_hashes_follow_the_tokens_and_hash_each_block_once(monkeypatch):
    calls = []
    original = request_module.extend_block_hashes
    monkeypatch.setattr(
        request_module,
        "extend_block_hashes",
        lambda hashes, tokens, *args: calls.append(len(tokens)) or original(hashes, tokens, *args),
    )
    request = Request("r", list(range(10)), SamplingParams(), cache_salt="salt")
    request.enable_block_hashing(4)
    for token in range(100, 120):
        request.append_output_token_id(token)
        assert request.block_hashes == block_hashes(request.all_token_ids, 4, "salt")
    # One call at start, then one per block that filled: at 12, 16, 20, 24, 28 tokens.
    assert calls == [10, 12, 16, 20, 24, 28]
    assert request.output_token_ids == list(range(100, 120)) and request.num_tokens == 30


def test_block_hashes_stay_empty_without_prefix_caching():
    request = Request("r", list(range(10)), SamplingParams())
    request.append_output_token_id(5)
    assert request.block_hashes == []


def test_prompt_logprobs_recomputed_after_preemption_are_not_sent_twice():
    request = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(prompt_logprobs=0))
    entry = {p: TokenLogprobs([p], [-float(p)], 1) for p in range(1, 6)}
    assert request.wants_prompt_logprobs
    assert request.take_prompt_logprobs(PromptLogprobs(1, [entry[1], entry[2]])) == [
        entry[1],
        entry[2],
    ]
    # Recomputed from the start: positions 1 and 2 again, then on.
    assert request.take_prompt_logprobs(PromptLogprobs(1, [entry[1]])) == []
    assert request.take_prompt_logprobs(PromptLogprobs(2, [entry[2], entry[3]])) == [entry[3]]
    assert request.wants_prompt_logprobs
    assert request.take_prompt_logprobs(PromptLogprobs(4, [entry[4], entry[5]])) == [
        entry[4],
        entry[5],
    ]
    assert not request.wants_prompt_logprobs  # all sent: a prefix-cache hit is fine now
    assert not Request("p", [1, 2], SamplingParams()).wants_prompt_logprobs
