"""server/aio.py: several streams read as one, several awaitables awaited as one; an error
or an early stop leaves nothing running."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from server.aio import gather_or_cancel, interleaved


class Stream:
    """Yields `name`0.. with a pause before each; records whether it was closed, and
    raises after `fail_after` items if set."""

    def __init__(self, name: str, count: int, pause: float, fail_after: int | None = None):
        self.name, self.count, self.pause, self.fail_after = name, count, pause, fail_after
        self.closed = False

    async def items(self):
        try:
            for i in range(self.count):
                if i == self.fail_after:
                    raise ValueError(f"{self.name} failed")
                await asyncio.sleep(self.pause)
                yield f"{self.name}{i}"
        finally:
            self.closed = True


def test_every_item_comes_each_stream_in_its_order():
    streams = [Stream("a", 4, 0.003), Stream("b", 3, 0.001), Stream("c", 1, 0.0)]

    async def run():
        return [item async for item in interleaved([s.items() for s in streams])]

    got = asyncio.run(run())
    assert sorted(got) == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "c0"]
    for s in streams:
        mine = [item for item in got if item[0] == s.name]
        assert mine == [f"{s.name}{i}" for i in range(s.count)]
    assert got.index("b2") < got.index("a3")  # interleaved, not one stream after another
    assert all(s.closed for s in streams)


def test_an_error_in_one_stream_ends_and_closes_them_all():
    streams = [Stream("a", 100, 0.001), Stream("b", 5, 0.002, fail_after=2)]

    async def run():
        async with aclosing(interleaved([s.items() for s in streams])) as items:
            async for _ in items:
                pass

    with pytest.raises(ValueError, match="b failed"):
        asyncio.run(run())
    assert all(s.closed for s in streams)


def test_stopping_early_closes_every_stream():
    streams = [Stream("a", 100, 0.001), Stream("b", 100, 0.001)]

    async def run():
        async with aclosing(interleaved([s.items() for s in streams])) as items:
            async for item in items:
                if item == "a3":
                    break

    asyncio.run(run())
    assert all(s.closed for s in streams)


def test_gather_or_cancel_cancels_the_rest_at_the_first_error():
    cancelled = []

    async def slow(name: str):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def fails():
        await asyncio.sleep(0.01)
        raise KeyError("boom")

    async def run():
        both = await gather_or_cancel([asyncio.sleep(0.01, "x"), asyncio.sleep(0, "y")])
        assert both == ["x", "y"]
        await gather_or_cancel([slow("a"), fails(), slow("b")])

    with pytest.raises(KeyError):
        asyncio.run(run())
    assert sorted(cancelled) == ["a", "b"]
