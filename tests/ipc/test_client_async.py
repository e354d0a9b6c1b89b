"""AsyncEngineClient against the scripted fake EngineCore (tests/ipc/client_fakes.py)."""

import asyncio
import time

import pytest
from client_fakes import FAIL_MESSAGE, FAIL_TOKEN, FakeEngine, tiny_tokenizer_path

from ipc.client import AsyncEngineClient, EngineDeadError, RequestError
from ipc.messages import SchedulerStats
from ipc.sampling_params import SamplingParams
from ipc.sockets import new_ipc_address, remove_ipc_files


@pytest.fixture
def engine():
    with FakeEngine() as engine:
        yield engine


def run(engine, body, **kwargs):
    """Run `body(client)` with a client connected to `engine`."""

    async def main():
        async with AsyncEngineClient(engine.address, **kwargs) as client:
            return await body(client)

    return asyncio.run(main())


def test_generate_and_stream_agree(engine):
    async def body(client):
        params = SamplingParams(max_tokens=20)
        whole = await client.generate("añ 日本 🙂!", params)
        deltas = [d async for d in client.stream("añ 日本 🙂!", params)]
        return whole, deltas

    whole, deltas = run(engine, body, tokenizer=tiny_tokenizer_path())
    expected = (list("añ 日本 🙂!".encode()) * 2)[:20]
    assert whole.outputs[0].token_ids == expected
    assert whole.outputs[0].text == bytes(expected).decode() and whole.finished
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected
    pieces = [d.outputs[0].text for d in deltas]
    assert "".join(pieces) == whole.outputs[0].text
    assert not any("\ufffd" in p for p in pieces)
    assert [d.finished for d in deltas] == [False] * 19 + [True]
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_stop_string_truncates_and_aborts(engine):
    async def body(client):
        return await client.generate("one two STOP", SamplingParams(max_tokens=5000, stop=["STOP"]))

    out = run(engine, body, tokenizer=tiny_tokenizer_path())
    assert out.outputs[0].text == "one two " and out.outputs[0].finish_reason == "stop"
    assert engine.wait_for(lambda: out.request_id in engine.aborted)


def test_a_cancelled_consumer_aborts_the_request(engine):
    async def body(client):
        task = asyncio.create_task(
            client.generate([1, 2], SamplingParams(max_tokens=10_000), request_id="cancelled")
        )
        while not any(r.request_id == "cancelled" for r in engine.requests):
            await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(engine, body)
    assert engine.wait_for(lambda: "cancelled" in engine.aborted)


def test_closing_a_stream_early_aborts_the_request(engine):
    async def body(client):
        stream = client.stream([1, 2], SamplingParams(max_tokens=10_000), request_id="early")
        first = await anext(stream)
        await stream.aclose()
        return first

    assert run(engine, body).outputs[0].token_ids == [1]
    assert engine.wait_for(lambda: "early" in engine.aborted)


def test_concurrent_tasks_each_see_only_their_own_outputs(engine):
    async def one(client, i):
        prompt = [10 * i + 1, 10 * i + 2]
        out = await client.generate(prompt, SamplingParams(max_tokens=21))
        streamed = [t async for d in client.stream(prompt) for t in d.outputs[0].token_ids]
        return out.outputs[0].token_ids, streamed

    async def body(client):
        return await asyncio.gather(*(one(client, i) for i in range(8)))

    for i, (generated, streamed) in enumerate(run(engine, body)):
        prompt = [10 * i + 1, 10 * i + 2]
        assert generated == (prompt * 11)[:21]
        assert streamed == (prompt * 8)[:16]


def test_engine_side_error_raises_request_error(engine):
    async def body(client):
        with pytest.raises(RequestError, match=FAIL_MESSAGE):
            await client.generate([FAIL_TOKEN])
        with pytest.raises(RequestError, match=FAIL_MESSAGE):
            [d async for d in client.stream([FAIL_TOKEN, 1])]
        return await client.generate([4], SamplingParams(max_tokens=2))

    assert run(engine, body).outputs[0].token_ids == [4, 4]


def test_abort_ends_a_running_generate(engine):
    async def body(client):
        task = asyncio.create_task(
            client.generate([1], SamplingParams(max_tokens=10_000), request_id="victim")
        )
        while not any(r.request_id == "victim" for r in engine.requests):
            await asyncio.sleep(0.002)
        await client.abort("victim")
        return await task

    out = run(engine, body)
    assert out.outputs[0].finish_reason == "abort" and out.finished
    assert engine.wait_for(lambda: "victim" in engine.aborted)


def test_utility_calls_and_a_silent_engine(engine):
    async def body(client):
        assert await client.health()
        assert await client.reset_prefix_cache() is True
        assert isinstance(await client.stats(), SchedulerStats)
        engine.answer_utilities = False
        assert await client.health(timeout=0.2) is False
        with pytest.raises(EngineDeadError, match="stats"):
            await client.stats(timeout=0.2)
        engine.frozen = True
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            await client.generate([1])
        return time.monotonic() - start

    assert run(engine, body, health_interval=0.2) < 2


def test_connecting_to_an_address_with_no_engine_fails_fast_and_clearly():
    address = new_ipc_address()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"no EngineCore answering at {address}"):
        asyncio.run(AsyncEngineClient.create(address, connect_timeout=0.2))
    assert time.monotonic() - start < 1.5
    remove_ipc_files(address)


def test_calls_before_connect_are_refused(engine):
    client = AsyncEngineClient(engine.address)
    with pytest.raises(RuntimeError, match="connect"):
        asyncio.run(client.generate([1]))
