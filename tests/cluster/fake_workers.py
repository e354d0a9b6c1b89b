"""Fake workers for the MultiprocExecutor tests: raw DEALERs on the executor's workers
socket that speak the worker protocol by hand."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from ipc.messages import (
    TO_WORKERS,
    CachedRequestData,
    Decoder,
    InitKVCache,
    KVCacheReady,
    SchedulerOutput,
    WorkerReady,
    encode,
)
from ipc.sockets import socket_address

decoder = Decoder(*TO_WORKERS)  # what a worker receives


def connect(ctx: zmq.Context, address: str, identity: bytes | None = None) -> zmq.Socket:
    """A DEALER on the workers socket of the executor at `address`, as a worker connects."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(socket_address(address, "workers"))
    return sock


def worker_ready(rank: int, blocks: int = 8, pid: int | None = None) -> bytes:
    """The WorkerReady of a rank with `blocks` KV blocks, in process `pid` (by default this
    one) on this host."""
    pid = os.getpid() if pid is None else pid
    return encode(WorkerReady(rank, blocks, pid, socket.gethostname()))


def answer_init_kv_caches(workers: list[zmq.Socket]) -> list[InitKVCache]:
    """Each fake rank takes its InitKVCache and answers KVCacheReady, as a worker does once
    its cache exists. Returns the InitKVCache each rank got."""
    inits = []
    for rank, sock in enumerate(workers):
        assert sock.poll(5000), f"rank {rank} got no InitKVCache"
        init = decoder.decode(sock.recv())
        assert isinstance(init, InitKVCache)
        inits.append(init)
        sock.send(encode(KVCacheReady(rank)))
    return inits


def init_kv_caches(call: Callable[[], Any], workers: list[zmq.Socket]) -> tuple[Any, list]:
    """Run `call` (initialize_workers or replace_workers) while the fake workers answer
    their InitKVCache. Returns what `call` returned and the InitKVCache each rank got."""
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(call)
        inits = answer_init_kv_caches(workers)
        return result.result(timeout=5), inits


def one_token_step(step_id: int) -> SchedulerOutput:
    """A step that schedules one token of request "a"."""
    return SchedulerOutput(step_id, [], CachedRequestData(), {"a": 1}, 1)
