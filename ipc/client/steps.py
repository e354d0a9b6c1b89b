"""The waits both clients do, written once: for a request's next delta, for a utility
call's answer, for WELCOME.

Each wait is a generator that yields the I/O it needs (a `Step`), is sent back that
step's result, and returns its own. `run` does the steps blocking (EngineClient's
thread), `run_async` awaiting (AsyncEngineClient's event loop); each client only says
how it waits on its own queues, futures and sockets.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from ipc.auth import CredentialsError
from ipc.client.core import ClientCore
from ipc.client.errors import EngineDeadError
from ipc.client.output_processor import Handle
from ipc.outputs import RequestOutput

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NextItem:
    """The next item of a request's queue (a RequestOutput or an exception), or None
    when none comes within `timeout` s."""

    queue: Any
    timeout: float


@dataclass(frozen=True, slots=True)
class Answer:
    """Whether `future` is done, waiting for it up to `timeout` s."""

    future: concurrent.futures.Future
    timeout: float


@dataclass(frozen=True, slots=True)
class Receive:
    """Handle what the engine sends for up to `timeout_ms` ms (result None)."""

    timeout_ms: int


Step = NextItem | Answer | Receive
Steps = Generator[Step, Any, T]


def next_delta(core: ClientCore, handle: Handle, health_interval: float) -> Steps[RequestOutput]:
    """The request's next delta; raises what failed the request. Each time the engine
    stays silent for `health_interval`, ask for its health (EngineDeadError when that
    goes unanswered as long)."""
    while (item := (yield NextItem(handle.queue, health_interval))) is None:
        yield from call(core, "health", health_interval)
    if isinstance(item, Exception):
        raise item
    return item


def call(core: ClientCore, method: str, timeout: float) -> Steps[Any]:
    """A utility call's answer; EngineDeadError when none comes within `timeout` s."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    call_id = core.start_call(method, future)
    try:
        answered = yield Answer(future, timeout)
    finally:
        core.drop_call(call_id)
    if not answered:
        raise EngineDeadError(
            f"the EngineCore at {core.address} did not answer {method!r} within {timeout:g} s"
        )
    return future.result()


def health(core: ClientCore, timeout: float) -> Steps[bool]:
    try:
        return bool((yield from call(core, "health", timeout)))
    except EngineDeadError:
        return False


def welcome(core: ClientCore, timeout: float) -> Steps[None]:
    """Wait for WELCOME (the caller has sent HELLO) or a refused handshake."""
    deadline = time.monotonic() + timeout
    while not core.connected:
        error = core.connection_error()
        if isinstance(error, CredentialsError):
            raise error
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"no EngineCore answering at {core.address} (waited {timeout:g} s for WELCOME)"
            )
        yield Receive(int(left * 1000) + 1)


def run(steps: Steps[T], wait: Callable[[Step], Any]) -> T:
    """Do each step with `wait`; closing `steps` on the way out runs their cleanup."""
    reply = None
    with contextlib.closing(steps):
        while True:
            try:
                step = steps.send(reply)
            except StopIteration as stop:
                return stop.value
            reply = wait(step)


async def run_async(steps: Steps[T], wait: Callable[[Step], Awaitable[Any]]) -> T:
    """`run`, awaiting each step."""
    reply = None
    with contextlib.closing(steps):
        while True:
            try:
                step = steps.send(reply)
            except StopIteration as stop:
                return stop.value
            reply = await wait(step)
