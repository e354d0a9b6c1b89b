"""Garbage and invalid requests from raw ZMQ DEALERs: each gets a clear error (or is
dropped with a log line), and the EngineCore goes on serving correct answers."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from ipc.client import EngineClient
from ipc.messages import (
    TO_CLIENTS,
    Decoder,
    EngineCoreRequest,
    FinishReason,
    UtilityOutput,
    encode,
)
from ipc.sampling_params import SamplingParams
from ipc.sockets import HELLO, WELCOME, socket_address
from tests.cluster.helpers import wait_idle
from tests.integration.greedy import greedy_reference

NUM_GARBAGE = 1000
PROMPT = [72, 101, 108, 108, 111]


def _raw(request_id: str, prompt, params) -> bytes:
    return msgspec.msgpack.encode(["EngineCoreRequest", request_id, prompt, params, 0.0])


def _request(request_id: str, prompt: list[int], **params) -> bytes:
    return encode(EngineCoreRequest(request_id, prompt, SamplingParams(**params), time.time()))


# request_id -> (frame, a word the error must contain; None: served normally)
INVALID = {
    "negative-max-tokens": (
        _raw("negative-max-tokens", PROMPT, [1, 1.0, 1.0, 0, 0.0, None, -3]),
        "max_tokens",
    ),
    "bad-utf8-stop": (
        _raw("bad-utf8-stop", PROMPT, [1, 1.0, 1.0, 0, 0.0, None, 4, 0, ["@@"]]).replace(
            b"@@", b"\xff\xfe"
        ),
        "utf-8",
    ),
    "params-as-map": (_raw("params-as-map", PROMPT, {"max_tokens": 3, "colour": "red"}), "array"),
    "prompt-not-a-list": (_raw("prompt-not-a-list", "hello", []), "array"),
    "token-not-an-int": (_raw("token-not-an-int", [1, "two"], []), "int"),
    "too-long": (_request("too-long", [1] * 600, max_tokens=4), "max_model_len"),
    "empty": (_request("empty", [], max_tokens=4), "empty"),
    "bad-token-id": (_request("bad-token-id", [1, 10**6], max_tokens=4), "token ids"),
    # Trailing unknown fields are ignored (msgspec's forward compatibility).
    "extra-fields": (
        msgspec.msgpack.encode(
            [*msgspec.msgpack.decode(_request("extra-fields", PROMPT, max_tokens=2)), "x", 1]
        ),
        None,
    ),
}


@pytest.fixture
def raw_client(llama_tp1):
    """A DEALER pair with one identity that said HELLO on the output socket."""
    ctx = zmq.Context()
    identity = b"\x01raw-client"
    sockets = []
    for role in ("input", "output"):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(socket_address(llama_tp1.address, role))
        sockets.append(sock)
    sockets[1].send(HELLO)
    assert sockets[1].poll(10_000) and sockets[1].recv() == WELCOME
    yield sockets
    for sock in sockets:
        sock.close()
    ctx.term()


def test_garbage_frames_get_errors_and_the_engine_goes_on(llama_tp1, raw_client):
    send, receive = raw_client
    rng = random.Random(0)
    for _ in range(NUM_GARBAGE):
        send.send(rng.randbytes(rng.randrange(1, 80)))
    send.send_multipart([b"two", b"frames"])
    for frame, _ in INVALID.values():
        send.send(frame)

    decoder = Decoder(*TO_CLIENTS)
    undecodable, finished = 0, {}
    deadline = time.monotonic() + 30
    while (undecodable < NUM_GARBAGE + 1 or len(finished) < len(INVALID)) and receive.poll(
        max(0, int(1000 * (deadline - time.monotonic())))
    ):
        msg = decoder.decode(receive.recv())
        if isinstance(msg, UtilityOutput):
            assert msg.call_id == -1 and msg.error.startswith(("bad frame", "expected one frame"))
            undecodable += 1
            continue
        for out in msg.outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert undecodable == NUM_GARBAGE + 1, llama_tp1.output()[-3000:]
    assert set(finished) == set(INVALID)
    for request_id, (_, word) in INVALID.items():
        out = finished[request_id]
        if word is None:
            assert out.finish_reason == FinishReason.LENGTH and len(out.new_token_ids) > 0
        else:
            assert out.finish_reason == FinishReason.ERROR and word in out.error.lower(), (
                request_id,
                out.error,
            )
    assert llama_tp1.output().count("bad frame from client") >= NUM_GARBAGE + 1

    with EngineClient(llama_tp1.address) as client:
        answer = client.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        assert wait_idle(client).kv_cache_usage == 0.0
    assert answer.outputs[0].token_ids == greedy_reference(llama_tp1.model, ignore_eos=False)(
        PROMPT, 8
    )


def test_requests_of_a_vanished_client_are_aborted(llama_tp1):
    ctx = zmq.Context()
    send = ctx.socket(zmq.DEALER)
    send.setsockopt(zmq.LINGER, 1000)
    send.connect(socket_address(llama_tp1.address, "input"))
    # No HELLO on the output socket: the engine cannot route this client's outputs.
    send.send(_request("orphan", PROMPT, max_tokens=400, ignore_eos=True))
    send.close()
    ctx.term()
    with EngineClient(llama_tp1.address) as client:
        deadline = time.monotonic() + 10
        while client.stats().num_generation_tokens == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = wait_idle(client)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert "is not connected; dropped its output" in llama_tp1.output()
