"""Running several async streams and awaitables as one: their items as they come, their
results together; at the first error, or when the caller stops, every one is cancelled
(and its stream closed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

T = TypeVar("T")


async def interleaved(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream as they come, each stream's in its order. An error in one
    stream ends them all; closing this closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]):
            async for item in streams[0]:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    ended = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((item, None))
        except Exception as e:
            await queue.put((None, e))
        else:
            await queue.put((ended, None))

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is ended:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


async def gather_or_cancel(works: list[Awaitable[T]]) -> list[T]:
    """Every result, in order; at the first error (or a cancel) the rest are cancelled."""
    if len(works) == 1:
        return [await works[0]]
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
