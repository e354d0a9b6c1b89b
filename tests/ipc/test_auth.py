"""CURVE credentials (ipc/auth.py), exact tcp binds and private ipc folders, and the
clients against a stand-in engine on tcp: only the cluster's client key gets in, and a
client without it fails at once with CredentialsError instead of timing out."""

import asyncio
import os
import socket
import stat
import time
from pathlib import Path

import pytest
import zmq
from client_fakes import FakeEngine

from ipc.auth import CLIENT, WORKER, Credentials, CredentialsError, credentials_beside
from ipc.client import AsyncEngineClient, EngineClient
from ipc.sampling_params import SamplingParams
from ipc.sockets import (
    free_tcp_port,
    make_socket,
    new_ipc_address,
    remove_ipc_files,
    socket_address,
    write_address_file,
)

PARAMS = SamplingParams(max_tokens=3)


@pytest.fixture(scope="module")
def keys() -> Credentials:
    return Credentials.generate()


@pytest.fixture
def engine(keys):
    with FakeEngine(address=f"tcp://127.0.0.1:{free_tcp_port()}", credentials=keys) as engine:
        yield engine


def test_credentials_files_are_private_and_each_role_gets_its_part(tmp_path, keys):
    path = tmp_path / "cluster.credentials"
    keys.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Credentials.load(path) == keys
    client = keys.for_role(CLIENT)
    assert client.server_secret is None and client.worker_secret is None
    assert client.keypair(CLIENT) == (keys.client_public, keys.client_secret)
    with pytest.raises(CredentialsError, match="no worker key pair"):
        client.keypair(WORKER)
    for mode in (0o640, 0o604):
        path.chmod(mode)
        with pytest.raises(CredentialsError, match="readable by others"):
            Credentials.load(path)


def test_ipc_sockets_live_in_a_private_folder():
    address = new_ipc_address()
    folder = Path(address[len("ipc://") :]).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    remove_ipc_files(address)


def test_tcp_binds_exactly_the_given_host(keys):
    """Bound on 127.0.0.1, the port is free on every other address of the machine."""
    port = free_tcp_port()
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, f"tcp://127.0.0.1:{port}", True, None, keys, CLIENT)
    try:
        listening = _listening_addresses()
        assert ("127.0.0.1", port) in listening
        assert not [a for a in listening if a[1] == port and a[0] != "127.0.0.1"]
        other_ip = _other_local_ip()
        if other_ip is not None:
            with socket.socket() as other:
                other.bind((other_ip, port))  # fails if the engine took every interface
    finally:
        sock.close()
        ctx.term()


def test_tcp_sockets_refuse_to_go_without_credentials():
    ctx = zmq.Context()
    with pytest.raises(ValueError, match="credentials"):
        make_socket(ctx, zmq.ROUTER, f"tcp://127.0.0.1:{free_tcp_port()}", True)
    ctx.term()


def test_an_authenticated_client_is_served(engine, keys, tmp_path):
    with EngineClient(engine.address, credentials=keys.for_role(CLIENT)) as client:
        assert client.generate([7], PARAMS).outputs[0].token_ids == [7] * 3
    # Given an address file, the client finds the credentials beside it.
    address_file = tmp_path / "engine.address"
    write_address_file(address_file, engine.address)
    keys.for_role(CLIENT).save(credentials_beside(address_file))
    with EngineClient(str(address_file)) as client:
        assert client.generate([8], PARAMS).outputs[0].token_ids == [8] * 3


def test_clients_without_the_client_key_fail_fast_and_clearly(engine, keys):
    with pytest.raises(CredentialsError, match="authenticated clients only"):
        EngineClient(engine.address)
    with pytest.raises(CredentialsError, match="no client key pair"):
        EngineClient(engine.address, credentials=keys.for_role(WORKER))
    other = Credentials.generate()
    wrong_key = Credentials(keys.server_public, None, other.client_public, other.client_secret)
    wrong_server = Credentials(other.server_public, None, keys.client_public, keys.client_secret)
    for credentials, message in ((wrong_key, "refused"), (wrong_server, "handshake")):
        start = time.monotonic()
        with pytest.raises(CredentialsError, match=message):
            EngineClient(engine.address, connect_timeout=20, credentials=credentials)
        assert time.monotonic() - start < 5

        async def connect(credentials=credentials):
            await AsyncEngineClient.create(
                engine.address, connect_timeout=20, credentials=credentials
            )

        start = time.monotonic()
        with pytest.raises(CredentialsError, match=message):
            asyncio.run(connect())
        assert time.monotonic() - start < 5
    assert engine.requests == [] and engine.clients == set()


def test_a_plain_zmq_peer_gets_nothing_from_a_tcp_engine(engine):
    ctx = zmq.Context()
    output = ctx.socket(zmq.DEALER)
    output.setsockopt(zmq.LINGER, 0)
    output.connect(socket_address(engine.address, "output"))
    output.send(b"HELLO")
    assert not output.poll(500)
    output.close()
    ctx.term()
    assert engine.clients == set()


def _other_local_ip() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent
        except OSError:
            return None
        ip = probe.getsockname()[0]
    return None if ip.startswith("127.") else ip


def _listening_addresses() -> set[tuple[str, int]]:
    """(ip, port) of every listening IPv4/IPv6 tcp socket of the machine."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            if state == "0A":
                found.add(_decode(local))
    return found


def _decode(hex_address: str) -> tuple[str, int]:
    ip, port = hex_address.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)
