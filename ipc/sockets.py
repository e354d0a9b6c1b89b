"""ZeroMQ addresses and sockets.

One engine address names three sockets that the EngineCore binds:

* input   — clients' DEALERs send EngineCoreRequest / AbortRequests / UtilityRequest;
* output  — clients' DEALERs (same identity as their input DEALER) receive
            EngineCoreOutputs / UtilityOutput;
* workers — workers' DEALERs send WorkerReady / ModelRunnerOutput / WorkerError and
            receive InitKVCache / SchedulerOutput / Shutdown.

`ipc:///tmp/splitserve-x/engine` derives `…/engine-input`, `-output`, `-workers`;
`tcp://host:port` derives ports port, port+1 and port+2. A client's output DEALER
sends HELLO and waits for WELCOME before its first request, so the engine's output
ROUTER knows the client's identity before any output is routed to it.
"""

import contextlib
import os
import socket
import tempfile
from pathlib import Path

import zmq

HELLO = b"HELLO"
WELCOME = b"WELCOME"
_ROLES = ("input", "output", "workers")


def new_ipc_address() -> str:
    """A fresh ipc:// address in its own temp folder, so clusters never collide."""
    return f"ipc://{tempfile.mkdtemp(prefix='splitserve-')}/engine"


def free_tcp_port(host: str = "127.0.0.1", count: int = 3) -> int:
    """A port p such that p .. p+count-1 were all free a moment ago."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + count < 65536 and all(_port_free(host, port + i) for i in range(1, count)):
            return port


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def socket_address(address: str, role: str) -> str:
    """The address of one of the engine's sockets (`role` in input/output/workers)."""
    index = _ROLES.index(role)
    if address.startswith("ipc://"):
        return f"{address}-{role}"
    if address.startswith("tcp://"):
        host, port = address[len("tcp://") :].rsplit(":", 1)
        return f"tcp://{host}:{int(port) + index}"
    raise ValueError(f"engine address must start with ipc:// or tcp://, got {address!r}")


def bind_address(address: str) -> str:
    """What to bind for `address`: a tcp host becomes every interface."""
    if address.startswith("tcp://"):
        return "tcp://*:" + address.rsplit(":", 1)[1]
    return address


def ipc_paths(address: str) -> list[Path]:
    """The socket files an ipc:// engine address creates (empty for tcp)."""
    if not address.startswith("ipc://"):
        return []
    return [Path(socket_address(address, role)[len("ipc://") :]) for role in _ROLES]


def remove_ipc_files(address: str) -> None:
    """Remove the socket files and the fresh folder new_ipc_address made for them."""
    paths = ipc_paths(address)
    for path in paths:
        path.unlink(missing_ok=True)
    if paths and paths[0].parent.name.startswith("splitserve-"):
        with contextlib.suppress(OSError):
            paths[0].parent.rmdir()


def make_socket(
    ctx: zmq.Context, kind: int, address: str, bind: bool, identity: bytes | None = None
) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if bind:
        sock.bind(bind_address(address))
    else:
        sock.connect(address)
    return sock


def write_address_file(path: str | os.PathLike, address: str) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(address + "\n")
    tmp.replace(path)


def read_address(address_or_file: str) -> str:
    """Accept an engine address or the path of a file that holds one."""
    if address_or_file.startswith(("ipc://", "tcp://")):
        return address_or_file
    return Path(address_or_file).read_text().strip()
