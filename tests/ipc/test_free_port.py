"""free_tcp_port draws below the kernel's ephemeral range, so no outgoing connection
(of any process) can take a port between the check and the bind."""

import socket

import pytest

from ipc import sockets
from ipc.sockets import free_tcp_port


@pytest.mark.parametrize(
    ("ephemeral", "low", "high"),
    [
        ("32768\t60999\n", 20000, 32766),
        ("1024 60999", 61000, 65533),
        ("1024 65535", 1024, 65533),
        ("", 20000, 49150),
    ],
    ids=["linux default", "low range", "whole range", "unreadable"],
)
def test_ports_come_from_outside_the_ephemeral_range(tmp_path, monkeypatch, ephemeral, low, high):
    path = tmp_path / "ip_local_port_range"
    if ephemeral:
        path.write_text(ephemeral)
    monkeypatch.setattr(sockets, "_EPHEMERAL_RANGE", path)
    assert sockets._listening_ports(3) == (low, high)
    for _ in range(20):
        port = free_tcp_port(count=3)
        assert low <= port < high


def test_every_port_of_the_block_binds():
    port = free_tcp_port(count=3)
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for s, p in zip((a, b, c), range(port, port + 3), strict=True):
            s.bind(("127.0.0.1", p))
