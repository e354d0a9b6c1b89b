"""The output ROUTER's backlog: a burst larger than the pipe reaches a client that reads,
in order; a client that never reads is dropped once its backlog stalls."""

from __future__ import annotations

import queue
import time

import pytest
import zmq

from engine_core import client_io
from engine_core.client_io import ClientGone, _Outbox

IDENTITY = b"reader"


@pytest.fixture
def pair(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 10)
    router.bind(f"ipc://{tmp_path}/out")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, IDENTITY)
    dealer.setsockopt(zmq.RCVHWM, 10)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(f"ipc://{tmp_path}/out")
    dealer.send(b"HELLO")
    assert router.poll(5000) and router.recv_multipart() == [IDENTITY, b"HELLO"]
    yield router, dealer
    for sock in (router, dealer):
        sock.close(linger=0)
    ctx.term()


def _outbox_after_a_burst(router: zmq.Socket) -> tuple[_Outbox, queue.Queue]:
    """An outbox on `router` handed 500 frames of 2 kB for the reader, and the queue on which
    it reports the clients it drops."""
    gone: queue.Queue = queue.Queue()
    out = _Outbox(router, gone)
    for i in range(500):
        out.deliver(IDENTITY, b"%06d" % i + bytes(2000))
    return out, gone


def test_a_burst_past_the_pipe_waits_in_the_backlog_and_arrives_in_order(pair):
    router, dealer = pair
    out, gone = _outbox_after_a_burst(router)
    assert out.backlogs[IDENTITY], "the burst should have filled the pipe"
    received = []
    deadline = time.monotonic() + 30
    while len(received) < 500 and time.monotonic() < deadline:
        out.retry()
        while dealer.poll(1):
            received.append(int(dealer.recv()[:6]))
    assert received == list(range(500))
    out.retry()
    assert out.backlogs == {} and gone.empty() and out.gone == set()


def test_a_client_that_never_reads_is_dropped_after_the_stall(pair, monkeypatch):
    monkeypatch.setattr(client_io, "_STALL_S", 0.2)
    router, _ = pair
    out, gone = _outbox_after_a_burst(router)
    deadline = time.monotonic() + 10
    while IDENTITY not in out.gone and time.monotonic() < deadline:
        out.retry()
        time.sleep(0.01)
    assert out.gone == {IDENTITY} and out.backlogs == {}
    assert gone.get_nowait() == (IDENTITY, ClientGone)
    out.deliver(IDENTITY, b"later")  # discarded, and its requests aborted again
    assert gone.get_nowait() == (IDENTITY, ClientGone)


def test_a_backlog_past_its_bound_drops_the_client(pair, monkeypatch):
    monkeypatch.setattr(client_io, "_MAX_BACKLOG", 50)
    router, _ = pair
    out, gone = _outbox_after_a_burst(router)
    assert out.gone == {IDENTITY} and out.backlogs == {}
    assert gone.get_nowait() == (IDENTITY, ClientGone)
