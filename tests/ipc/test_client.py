"""EngineClient against a scripted fake EngineCore (tests/ipc/client_fakes.py).

With the byte-level tiny tokenizer (ids 0-255 are the bytes) the expected text of any
token sequence is just those bytes decoded, independent of the client's detokenizer.
"""

import gc
import json
import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from client_fakes import FAIL_MESSAGE, FAIL_TOKEN, FakeEngine, tiny_tokenizer_path

from ipc.client import EngineClient, EngineDeadError, RequestError
from ipc.messages import SchedulerStats, UtilityOutput
from ipc.sampling_params import SamplingParams
from ipc.sockets import new_ipc_address, remove_ipc_files, write_address_file
from ipc.tokenizer import Tokenizer

IM_START, IM_END = 257, 258


@pytest.fixture
def engine():
    with FakeEngine() as engine:
        yield engine


@pytest.fixture
def client(engine):
    with EngineClient(engine.address, tiny_tokenizer_path()) as client:
        yield client


def test_generate_returns_the_engines_tokens_and_their_text(engine, tmp_path):
    address_file = tmp_path / "engine.address"
    write_address_file(address_file, engine.address)
    with EngineClient(str(address_file), tiny_tokenizer_path()) as client:
        out = client.generate("héllo", SamplingParams(max_tokens=9), request_id="r1")
    expected = list("héllo".encode()) * 2
    assert engine.requests[0].prompt_token_ids == list("héllo".encode())
    assert engine.requests[0].sampling_params.max_tokens == 9
    assert out.request_id == "r1" and out.finished
    assert out.outputs[0].token_ids == expected[:9]
    assert out.outputs[0].text == bytes(expected[:9]).decode(errors="ignore")
    assert out.outputs[0].finish_reason == "length"


def test_stream_deltas_add_up_to_generate(client):
    params = SamplingParams(max_tokens=20)
    whole = client.generate("stream me", params)
    deltas = list(client.stream("stream me", params))
    assert len(deltas) == 20
    assert [d.finished for d in deltas] == [False] * 19 + [True]
    assert deltas[-1].outputs[0].finish_reason == "length"
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.outputs[0].token_ids
    assert (
        "".join(d.outputs[0].text for d in deltas)
        == whole.outputs[0].text
        == "stream mestream mest"
    )


def test_multibyte_characters_split_across_tokens_stream_stable_text(client):
    text = "añ 日本 🙂!"
    ids = list(text.encode())
    deltas = list(client.stream(ids, SamplingParams(max_tokens=len(ids))))
    pieces = [d.outputs[0].text for d in deltas]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Each character arrives whole, with the token that completes it.
    assert [p for p in pieces if p] == list(text)


def test_a_bpe_tokenizer_streams_the_text_it_decodes_in_one_go():
    from models.default import default_model_path

    try:
        path = default_model_path()
    except RuntimeError as e:
        pytest.skip(f"default model unavailable: {e}")
    tokenizer = Tokenizer.from_pretrained(path)  # equal to transformers: test_tokenizer.py
    answer = tokenizer.encode(" Sure! Ünïcödé 🙂 日本語,  spaced   out.\nDone", False)
    with (
        FakeEngine(reply=lambda request: list(answer)) as engine,
        EngineClient(engine.address, tokenizer) as client,
    ):
        deltas = list(client.stream("Say something"))
    assert [t for d in deltas for t in d.outputs[0].token_ids] == answer
    assert "".join(d.outputs[0].text for d in deltas) == tokenizer.decode(answer)


def test_stop_string_truncates_the_text_and_aborts_the_request(engine, client):
    prompt = "one two STOP three "
    out = client.generate(prompt, SamplingParams(max_tokens=5000, stop=["STOP"]))
    assert out.outputs[0].text == "one two "
    assert out.outputs[0].finish_reason == "stop" and out.finished
    assert engine.wait_for(lambda: out.request_id in engine.aborted)
    assert len(out.outputs[0].token_ids) < 5000


def test_stop_string_is_not_reported_by_a_stream_either(client):
    deltas = list(client.stream("ab-cd-", SamplingParams(max_tokens=100, stop=["-c"])))
    assert "".join(d.outputs[0].text for d in deltas) == "ab"
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"


def test_closing_a_stream_early_aborts_the_request(engine, client):
    stream = client.stream([1, 2, 3], SamplingParams(max_tokens=10_000), request_id="early")
    assert next(stream).outputs[0].token_ids == [1]
    stream.close()
    assert engine.wait_for(lambda: "early" in engine.aborted)


def test_a_collected_stream_aborts_the_request(engine, client):
    stream = client.stream([1, 2, 3], SamplingParams(max_tokens=10_000), request_id="dropped")
    next(stream)
    del stream
    gc.collect()
    assert engine.wait_for(lambda: "dropped" in engine.aborted)


def test_a_stream_never_started_sends_nothing(engine, client):
    client.stream([1, 2, 3])
    client.generate([4])
    assert [r.prompt_token_ids for r in engine.requests] == [[4]]


def test_engine_side_error_raises_request_error(client):
    with pytest.raises(RequestError, match=FAIL_MESSAGE):
        client.generate([FAIL_TOKEN, 1, 2])
    with pytest.raises(ValueError, match=FAIL_MESSAGE):
        list(client.stream([FAIL_TOKEN]))
    assert client.generate([7], SamplingParams(max_tokens=2)).outputs[0].token_ids == [7, 7]


def test_concurrent_threads_each_see_only_their_own_outputs(engine):
    def run(i: int) -> None:
        prompt = [10 * i + 1, 10 * i + 2, 10 * i + 3]
        for _ in range(3):
            out = client.generate(prompt, SamplingParams(max_tokens=25))
            assert out.outputs[0].token_ids == (prompt * 9)[:25]
            streamed = [t for d in client.stream(prompt) for t in d.outputs[0].token_ids]
            assert streamed == (prompt * 6)[:16]
            assert out.outputs[0].text == ""  # no tokenizer

    with EngineClient(engine.address) as client, ThreadPoolExecutor(8) as pool:
        list(pool.map(run, range(8)))
    assert len(engine.requests) == 8 * 3 * 2


CHILD = """
import json, sys
from ipc.client import EngineClient
from ipc.sampling_params import SamplingParams
with EngineClient(sys.argv[1]) as client:
    prompt, params = [int(sys.argv[2])] * 3, SamplingParams(max_tokens=30)
    outs = [client.generate(prompt, params) for _ in range(5)]
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_two_client_processes_share_one_engine(engine):
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, engine.address, str(k)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in (5, 6)
    ]
    results = [json.loads(child.communicate(timeout=20)[0]) for child in children]
    assert results == [[[5] * 30] * 5, [[6] * 30] * 5]
    assert len(engine.clients) == 2


def test_a_request_the_encoder_refuses_is_not_left_registered(engine, client):
    with pytest.raises(OverflowError):
        client.generate([1, 2**64], SamplingParams(max_tokens=2))
    assert not client._core.output_processor.has_unfinished_requests()
    assert client.generate([1, 2], SamplingParams(max_tokens=2)).finished


def test_a_live_request_id_cannot_be_reused(client):
    stream = client.stream([1], SamplingParams(max_tokens=10_000), request_id="same")
    next(stream)
    with pytest.raises(ValueError, match="same"):
        client.generate([2], request_id="same")
    stream.close()
    assert client.generate([2], request_id="same", sampling_params=SamplingParams(max_tokens=1))


def test_abort_ends_a_running_generate_with_abort(engine, client):
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=client.generate([1, 2], SamplingParams(max_tokens=10_000), request_id="victim")
        )
    )
    worker.start()
    assert engine.wait_for(lambda: any(r.request_id == "victim" for r in engine.requests))
    client.abort("victim")
    worker.join(5)
    assert result["out"].outputs[0].finish_reason == "abort" and result["out"].finished
    assert engine.wait_for(lambda: "victim" in engine.aborted)


def test_chat_applies_the_template_without_adding_special_tokens(engine, client):
    out = client.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5))
    expected = [IM_START, *b"user\nhi", IM_END, *b"\n", IM_START, *b"assistant\n"]
    assert engine.requests[0].prompt_token_ids == expected
    assert out.outputs[0].text == "user"  # the echo, special tokens skipped


def test_utility_calls(engine, client):
    assert client.health()
    assert client.reset_prefix_cache() is True
    stream = client.stream([1], SamplingParams(max_tokens=10_000))
    next(stream)
    stats = client.stats()
    assert isinstance(stats, SchedulerStats) and stats.num_running == 1
    stream.close()
    engine.answer_utilities = False
    start = time.monotonic()
    assert client.health(timeout=0.2) is False
    with pytest.raises(EngineDeadError, match="stats"):
        client.stats(timeout=0.2)
    assert time.monotonic() - start < 2


def test_a_silent_engine_fails_waiting_requests(engine):
    with EngineClient(engine.address, health_interval=0.2) as client:
        engine.frozen = True
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            client.generate([1, 2, 3])
        assert time.monotonic() - start < 2


def test_closing_the_client_aborts_its_live_requests(engine):
    client = EngineClient(engine.address)
    stream = client.stream([1], SamplingParams(max_tokens=10_000), request_id="orphan")
    next(stream)
    client.close()
    assert engine.wait_for(lambda: "orphan" in engine.aborted)
    with pytest.raises(RuntimeError, match="closed"):
        next(stream)
    with pytest.raises(RuntimeError, match="closed"):
        client.generate([1])


def test_an_undecodable_frame_report_is_logged(engine, client, caplog):
    with caplog.at_level(logging.ERROR, logger="ipc.client"):
        engine.broadcast(UtilityOutput(-1, error="bad frame: garbage"))
        assert engine.wait_for(lambda: "bad frame: garbage" in caplog.text)
    assert client.generate([3], SamplingParams(max_tokens=1)).outputs[0].token_ids == [3]


def test_text_prompts_and_stop_strings_need_a_tokenizer(engine):
    with EngineClient(engine.address) as client:
        with pytest.raises(ValueError, match="tokenizer"):
            client.generate("text")
        with pytest.raises(ValueError, match="tokenizer"):
            client.generate([1], SamplingParams(stop=["x"]))


def test_connecting_to_an_address_with_no_engine_fails_fast_and_clearly():
    address = new_ipc_address()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"no EngineCore answering at {address}"):
        EngineClient(address, connect_timeout=0.2)
    assert time.monotonic() - start < 1.5
    remove_ipc_files(address)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ipc.client", *args], capture_output=True, text=True, timeout=20
    )


def test_cli_streams_the_answer(engine):
    tokenizer = tiny_tokenizer_path()
    chat = _cli("--address", engine.address, "--model", tokenizer, "--max-tokens", "5", "hi")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == "user\n"
    plain = _cli(
        "--address",
        engine.address,
        "--tokenizer",
        tokenizer,
        "--no-chat",
        "héllo",
        "--max-tokens",
        "3",
    )
    assert plain.stdout == "hé\n"
    assert engine.requests[1].prompt_token_ids == list("héllo".encode())


def test_cli_without_a_tokenizer_says_what_to_pass(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_MODEL", raising=False)
    result = _cli("--address", "ipc:///nowhere/engine", "hi")
    assert result.returncode == 2
    assert "--tokenizer" in result.stderr and "SPLITSERVE_MODEL" in result.stderr


def test_bad_words_leave_tokenized_and_need_a_tokenizer(engine, client):
    client.generate("hi", SamplingParams(max_tokens=2, bad_words=["ab"]))
    sent = engine.requests[-1].sampling_params
    assert sent.bad_words_token_ids == [list(b"ab"), list(b" ab")]
    with (
        EngineClient(engine.address) as bare,
        pytest.raises(ValueError, match="bad_words need a tokenizer"),
    ):
        bare.generate([1, 2], SamplingParams(bad_words=["ab"]))
