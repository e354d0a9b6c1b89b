"""Who may talk to a cluster, and how much it takes from them.

On tcp (`--engine-host 127.0.0.1`): every socket of the engine and the workers is on that host
(the engine's ports, the workers' rendezvous and gloo's), only holders of the client
key reach the client sockets, and the client key does not open the workers socket. On
ipc: a stranger on the workers socket cannot end the cluster, a client that stops
reading is dropped with its requests, and a huge frame is refused unread.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc.auth import CLIENT, Credentials, CredentialsError, credentials_beside
from ipc.client import EngineClient
from ipc.messages import (
    EngineCoreRequest,
    ModelRunnerOutput,
    UtilityRequest,
    WorkerError,
    WorkerReady,
    encode,
)
from ipc.sampling_params import SamplingParams
from ipc.sockets import HELLO, WELCOME, socket_address
from tests.cluster.helpers import launch_cluster, wait_idle

PROMPT = [5, 77, 3, 200]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def tcp_cluster(qwen3_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-tcp")
    with launch_cluster(folder, qwen3_path, "--tp", "2", "--engine-host", "127.0.0.1") as cluster:
        yield cluster


def _address_file(cluster) -> Path:
    return cluster.log.parent / "address"


@pytest.mark.gpus(2)
def test_every_socket_of_a_tcp_cluster_is_on_the_given_host(tcp_cluster):
    listening = set()
    for name, pid in tcp_cluster.pids.items():
        for local, remote, state in _tcp_sockets(pid):
            assert local[0] == "127.0.0.1", (name, local, remote, state)
            if state == "0A" and name == "engine core":
                listening.add(local[1])
    port = int(tcp_cluster.address.rsplit(":", 1)[1])
    assert {port, port + 1, port + 2} <= listening


@pytest.mark.gpus(2)
def test_an_authenticated_client_is_served(tcp_cluster):
    credentials = credentials_beside(_address_file(tcp_cluster))
    assert credentials.stat().st_mode & 0o077 == 0
    assert Credentials.load(credentials).server_secret is None  # the clients' part only
    with EngineClient(str(_address_file(tcp_cluster))) as client:
        assert len(client.generate(PROMPT, GREEDY).outputs[0].token_ids) == 4


@pytest.mark.gpus(2)
def test_unauthenticated_peers_can_neither_submit_nor_read_stats(tcp_cluster):
    with pytest.raises(CredentialsError):
        EngineClient(tcp_cluster.address)
    with EngineClient(str(_address_file(tcp_cluster))) as client:
        before = client.stats().num_prompt_tokens
        stranger = Credentials.generate()
        impostor = Credentials(
            Credentials.load(credentials_beside(_address_file(tcp_cluster))).server_public,
            client_public=stranger.client_public,
            client_secret=stranger.client_secret,
        )
        for credentials in (None, impostor):
            with _raw_pair(tcp_cluster.address, credentials) as (send, receive):
                receive.send(HELLO)
                send.send(encode(EngineCoreRequest("intruder", PROMPT, GREEDY, time.time())))
                send.send(encode(UtilityRequest(0, "stats")))
                assert not receive.poll(1000)
        assert client.stats().num_prompt_tokens == before
        assert len(client.generate(PROMPT, GREEDY).outputs[0].token_ids) == 4


@pytest.mark.gpus(2)
def test_the_client_key_does_not_open_the_workers_socket(tcp_cluster):
    keys = Credentials.load(credentials_beside(_address_file(tcp_cluster)))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey = keys.keypair(CLIENT)
    sock.curve_serverkey = keys.server_public
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sock.connect(socket_address(tcp_cluster.address, "workers"))
    sock.send(encode(WorkerReady(0, 1, os.getpid(), socket.gethostname())))
    sock.send(encode(WorkerError(0, "forged by a client", None)))
    assert monitor.poll(5000), "the workers socket took the client key"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    sock.disable_monitor()
    monitor.close()
    sock.close()
    ctx.term()
    with EngineClient(str(_address_file(tcp_cluster))) as client:
        assert len(client.generate(PROMPT, GREEDY).outputs[0].token_ids) == 4
    assert "forged by a client" not in tcp_cluster.output()


def test_strangers_on_the_workers_socket_cannot_end_the_cluster(llama_tp1):
    ctx = zmq.Context()
    strangers = []
    for identity in (b"stranger", b"worker-0"):  # the second: taken, so refused by ZMQ
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(socket_address(llama_tp1.address, "workers"))
        strangers.append(sock)
    forged = [
        WorkerError(0, "forged by a stranger", 0),
        WorkerReady(0, 1, os.getpid(), socket.gethostname()),
        ModelRunnerOutput(10**6, ["x"], [[1]]),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with EngineClient(llama_tp1.address) as client:
        stream = client.stream(PROMPT, params)
        next(stream)
        for sock in strangers:
            for message in forged:
                sock.send(encode(message))
        time.sleep(0.5)
        rest = list(stream)
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "length"
        assert len(client.generate(PROMPT, GREEDY).outputs[0].token_ids) == 4
    for sock in strangers:
        sock.close()
    ctx.term()
    assert "not a registered worker" in llama_tp1.output()
    assert "forged by a stranger" not in llama_tp1.output()


def test_a_client_that_stops_reading_is_dropped_and_the_engine_stays_small(llama_tp1):
    engine = llama_tp1.pids["engine core"]
    baseline = _status(engine, "VmRSS")
    # Never reads; a tiny receive buffer makes the engine's side fill up sooner.
    with _raw_pair(llama_tp1.address, None, rcvhwm=1, rcvbuf=4096) as (send, receive):
        receive.send(HELLO)
        assert receive.poll(10_000) and receive.recv() == WELCOME
        params = SamplingParams(max_tokens=480, ignore_eos=True, logprobs=5)
        largest, sent, deadline = baseline, 0, time.monotonic() + 90
        while "stopped reading its outputs" not in llama_tp1.output():
            assert time.monotonic() < deadline, "the engine never dropped the client"
            for _ in range(32):
                send.send(encode(EngineCoreRequest(f"slow-{sent}", PROMPT, params, time.time())))
                sent += 1
            for _ in range(20):
                largest = max(largest, _status(engine, "VmRSS"))
                time.sleep(0.1)
        with EngineClient(llama_tp1.address) as client:
            assert len(client.generate(PROMPT, GREEDY).outputs[0].token_ids) == 4
            stats = wait_idle(client, timeout=30)
        assert stats.num_running + stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert largest - baseline < 64 << 20


def test_a_huge_frame_is_refused_unread(llama_tp1):
    engine = llama_tp1.pids["engine core"]
    Path(f"/proc/{engine}/clear_refs").write_text("5")  # peak RSS := current RSS
    baseline = _status(engine, "VmHWM")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(socket_address(llama_tp1.address, "input"))
    sock.send(bytes(100 << 20))
    assert monitor.poll(10_000), "the engine took the whole frame"
    time.sleep(1.0)
    peak = _status(engine, "VmHWM")
    sock.disable_monitor()
    monitor.close()
    sock.close()
    ctx.term()
    assert peak - baseline < 32 << 20
    with EngineClient(llama_tp1.address) as client:
        assert len(client.generate(PROMPT, GREEDY).outputs[0].token_ids) == 4


class _raw_pair:
    """Input and output DEALERs with one identity, plain or with CURVE `credentials`."""

    def __init__(self, address: str, credentials: Credentials | None, **options: int) -> None:
        self.ctx = zmq.Context()
        self.sockets = []
        identity = b"\x01" + os.urandom(8)  # ZMQ reserves identities starting with 0
        for role in ("input", "output"):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, identity)
            for name, value in options.items():
                sock.setsockopt(getattr(zmq, name.upper()), value)
            if credentials is not None:
                sock.curve_publickey, sock.curve_secretkey = credentials.keypair(CLIENT)
                sock.curve_serverkey = credentials.server_public
            sock.connect(socket_address(address, role))
            self.sockets.append(sock)

    def __enter__(self) -> list[zmq.Socket]:
        return self.sockets

    def __exit__(self, *exc_info: object) -> None:
        for sock in self.sockets:
            sock.close()
        threading.Thread(target=self.ctx.term, daemon=True).start()


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status memory field, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _tcp_sockets(pid: int) -> list[tuple[tuple[str, int], tuple[str, int], str]]:
    """(local, remote, state) of the tcp sockets process `pid` holds (state 0A: listening)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append((_decode(fields[1]), _decode(fields[2]), fields[3]))
    return found


def _decode(hex_address: str) -> tuple[str, int]:
    ip, port = hex_address.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 16:
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        text = socket.inet_ntop(socket.AF_INET6, words)
        return text.removeprefix("::ffff:"), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
