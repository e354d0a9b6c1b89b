"""DataParallelClient over two scripted engines (tests/ipc/client_fakes.py): requests
spread by load, each engine's stats, and an engine that goes away: its requests fail with
EngineDeadError, new ones go to the other, and none is sent anywhere once both are gone."""

import asyncio

import pytest
from client_fakes import FakeEngine

from ipc.client import DataParallelClient, EngineDeadError
from ipc.client.dp_client import WAITING_WEIGHT
from ipc.messages import SchedulerStats
from ipc.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=100_000)


@pytest.fixture
def engines():
    with FakeEngine(step_delay=0.002) as a, FakeEngine(step_delay=0.002) as b:
        yield a, b


def run(engines, body):
    async def main():
        async with DataParallelClient([e.address for e in engines]) as client:
            return await body(client)

    return asyncio.run(main())


def test_requests_alternate_over_idle_engines_and_answer_whole(engines):
    async def body(client):
        outs = await asyncio.gather(
            *(client.generate([i, i + 1], SamplingParams(max_tokens=6)) for i in range(8))
        )
        return outs, await client.engine_stats()

    outs, stats = run(engines, body)
    assert [o.outputs[0].token_ids for o in outs] == [([i, i + 1] * 3) for i in range(8)]
    assert [len(e.requests) for e in engines] == [4, 4]
    assert [s.num_running for s in stats] == [0, 0]


def test_the_least_loaded_engine_gets_the_request(engines):
    """Load is waiting x 4 + running from the stats, plus 4 per request sent since."""

    async def body(client):
        client._load = [2 * WAITING_WEIGHT + 1, 0]  # engine 0: 2 waiting, 1 running
        return [client._choose() for _ in range(4)]

    assert run(engines, body) == [1, 1, 1, 0]


def test_streams_run_on_their_engine_and_the_index_is_known_while_they_live(engines):
    async def body(client):
        streams = [client.stream([7], LONG, request_id=f"r{i}") for i in range(2)]
        firsts = [await s.__anext__() for s in streams]
        where = [client.engine_index(f"r{i}") for i in range(2)]
        for s in streams:
            await s.aclose()
        return firsts, where, client.engine_index("r0")

    firsts, where, after = run(engines, body)
    assert all(f.outputs[0].token_ids == [7] for f in firsts)
    assert sorted(where) == [0, 1] and after == 0
    assert engines[0].wait_for(lambda: engines[0].aborted and engines[1].aborted)


def test_a_lost_engine_fails_its_requests_and_gets_no_new_one(engines):
    async def body(client):
        streams = [client.stream([1], LONG, request_id=f"r{i}") for i in range(2)]
        for s in streams:
            await s.__anext__()
        lost = client.engine_index("r1")
        engines[lost].__exit__(None, None, None)
        with pytest.raises(EngineDeadError):
            async for _ in streams[1 if lost == 1 else 0]:
                pass
        kept = await (streams[0 if lost == 1 else 1]).__anext__()
        assert kept.outputs[0].token_ids == [1]
        assert client.engine_index("r0" if lost == 1 else "r1") == 1 - lost
        placed = [client._choose() for _ in range(3)]
        stats = await client.engine_stats(timeout=1.0)
        healthy = await client.health()
        for s in streams:
            await s.aclose()
        return lost, placed, stats, healthy

    lost, placed, stats, healthy = run(engines, body)
    assert placed == [1 - lost] * 3
    assert stats[lost] is None and isinstance(stats[1 - lost], SchedulerStats)
    assert healthy


def test_no_engine_left_is_engine_dead(engines):
    async def body(client):
        for engine in engines:
            engine.__exit__(None, None, None)
        for _ in range(200):
            if not any(e.connected for e in client.engines):
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="no EngineCore"):
            await client.generate([1], SamplingParams(max_tokens=2))
        assert not await client.health(timeout=0.5)

    run(engines, body)
