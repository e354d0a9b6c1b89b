"""Wire messages: every struct survives encode/decode, bad values and bad frames are refused."""

import msgspec
import pytest

from ipc.messages import (
    AbortRequests,
    CachedRequestData,
    DecodeError,
    Decoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    FinishStep,
    InitKVCache,
    KVCacheReady,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
    UtilityOutput,
    UtilityRequest,
    WorkerError,
    WorkerReady,
    encode,
)
from ipc.sampling_params import SamplingParams

SP = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=3,
    max_tokens=20,
    min_tokens=2,
    stop=["\n\n"],
    stop_token_ids=[7, 9],
    ignore_eos=True,
    logprobs=2,
    skip_special_tokens=False,
    presence_penalty=0.5,
    frequency_penalty=-1.25,
    repetition_penalty=1.3,
    logit_bias={5: -100.0, 11: 2.5},
    allowed_token_ids=[5, 11, 12],
)
LOGPROBS = TokenLogprobs([5, 6, 7], [-0.1, -2.5, -3.0])
STATS = SchedulerStats(3, 4, 0.25, 100, 40, 2, 1000, 500)

TAGGED = [
    EngineCoreRequest("r1", [1, 2, 3], SP, 1234.5, priority=2, cache_salt="salt"),
    EngineCoreRequest("r2", [1], SamplingParams(), 0.0),
    AbortRequests(["r1", "r2"]),
    UtilityRequest(4, "reset_prefix_cache"),
    EngineCoreOutputs(
        [
            EngineCoreOutput("r1", [5], None, 16, [LOGPROBS]),
            EngineCoreOutput("r2", [], FinishReason.ERROR, error="the prompt is empty"),
        ],
        STATS,
    ),
    EngineCoreOutputs(),
    UtilityOutput(1, True),
    UtilityOutput(2, STATS),
    UtilityOutput(3, None, "no such method"),
    SchedulerOutput(
        7,
        [NewRequestData("r1", [1, 2, 3], SP, [[4, 5]], 0)],
        CachedRequestData(["r0", "r9"], [False, True], [[], [1, 2, 5]], [[[8]], [[1, 2]]], [12, 0]),
        {"r1": 3, "r0": 1, "r9": 3},
        7,
        ["r5"],
    ),
    SchedulerOutput(8, [], CachedRequestData(), {}, 0),
    ModelRunnerOutput(7, ["r1", "r0"], [[5], []], [[LOGPROBS], None]),
    ModelRunnerOutput(8, [], []),
    WorkerError(1, "CUDA out of memory", step_id=7),
    WorkerReady(0, 1024),
    KVCacheReady(1),
    InitKVCache(40, 70),
    FinishStep(7),
]
TAGGED_TYPES = sorted({type(m) for m in TAGGED}, key=lambda t: t.__name__)


@pytest.mark.parametrize("message", TAGGED, ids=lambda m: type(m).__name__)
def test_tagged_messages_round_trip_alone_and_through_a_union(message):
    frame = encode(message)
    assert Decoder(type(message)).decode(frame) == message
    assert Decoder(*TAGGED_TYPES).decode(frame) == message


@pytest.mark.parametrize(
    "struct",
    [
        SP,
        SamplingParams(),
        LOGPROBS,
        STATS,
        SchedulerStats(),
        TAGGED[4].outputs[0],
        NewRequestData("r", [1], SP, [[]], 0),
        CachedRequestData(),
    ],
    ids=lambda s: type(s).__name__,
)
def test_nested_structs_round_trip(struct):
    assert Decoder(type(struct)).decode(encode(struct)) == struct


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 129}, "best_of"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    # The same values arriving in a frame are refused by the decoder.
    fields = {**msgspec.structs.asdict(SamplingParams()), **kwargs}
    frame = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], list(fields.values()), 0.0])
    with pytest.raises(DecodeError, match=field):
        Decoder(EngineCoreRequest).decode(frame)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\x00\x01garbage\xff",
        encode(WorkerReady(0, 10))[:-1],  # truncated
        encode(WorkerReady(0, 10)),  # another message
        msgspec.msgpack.encode(["SchedulerOutput", 1]),  # too few fields
        msgspec.msgpack.encode(["SchedulerOutput", "x", [], [], {}, 0]),  # wrong field type
        msgspec.msgpack.encode(["NoSuchMessage", 1]),
        msgspec.msgpack.encode({"step_id": 1}),  # a map, not an array
        msgspec.msgpack.encode(["ModelRunnerOutput", 1, ["r"], [["x"]]]),
    ],
)
def test_bad_frames_raise_decode_error(frame):
    with pytest.raises(DecodeError, match="bad frame"):
        Decoder(SchedulerOutput, ModelRunnerOutput).decode(frame)


def test_logits_processing_settings_round_trip_with_int_token_ids():
    decoded = Decoder(SamplingParams).decode(encode(SP))
    assert decoded.logit_bias == {5: -100.0, 11: 2.5} and decoded.allowed_token_ids == [5, 11, 12]
