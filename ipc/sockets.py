"""ZeroMQ addresses and sockets.

One engine address names three sockets that the EngineCore binds:

* input   — clients' DEALERs send EngineCoreRequest / AbortRequests / UtilityRequest;
* output  — clients' DEALERs (same identity as their input DEALER) receive
            EngineCoreOutputs / UtilityOutput;
* workers — workers' DEALERs send WorkerReady / ModelRunnerOutput / WorkerError and
            receive InitKVCache / SchedulerOutput / Shutdown.

`ipc:///tmp/splitserve-x/engine` derives `…/engine-input`, `-output`, `-workers`;
`tcp://host:port` derives ports port, port+1 and port+2, bound on exactly that host and
authenticated with CURVE (ipc/auth.py). A client's output DEALER sends HELLO and waits
for WELCOME before its first request (and again after each reconnection), so the
engine's output ROUTER knows the client's identity before any output is routed to it.

Every socket is bounded: HWM messages queued per peer each way, and a socket that binds
drops (and disconnects) a peer whose message is larger than MAX_MESSAGE_BYTES.
"""

import os
import random
import shutil
import socket
import tempfile
from pathlib import Path

import zmq

from ipc.auth import CLIENT, Credentials, secure_socket

HELLO = b"HELLO"
WELCOME = b"WELCOME"
_ROLES = ("input", "output", "workers")
HWM = 1000  # messages queued per peer and direction
# A client buffers more of its own: a burst of requests, or a moment of not reading,
# must not fail it (the engine's own bound stays HWM).
CLIENT_HWM = 100_000
# Generous for a max_model_len prompt (msgpack takes at most 5 bytes per token id),
# small enough that one frame cannot balloon the engine.
MAX_MESSAGE_BYTES = 16 << 20
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FIRST_LISTENING_PORT = 20000


def new_ipc_address() -> str:
    """A fresh ipc:// address in its own temp folder (mode 0700: only this user can reach
    the sockets), so clusters never collide."""
    folder = tempfile.mkdtemp(prefix="splitserve-")
    os.chmod(folder, 0o700)
    address = f"ipc://{folder}/engine"
    try:
        ipc_paths(address)
    except ValueError as e:
        os.rmdir(folder)
        raise ValueError(f"{e}; set TMPDIR to a shorter folder") from None
    return address


def free_tcp_port(host: str = "127.0.0.1", count: int = 3) -> int:
    """A port p such that p .. p+count-1 were all free a moment ago.

    Chosen below the kernel's ephemeral range where it has one: a port the kernel may hand
    out as an outgoing connection's local port (any process's) can be taken between this
    check and the bind, and a cluster starting up makes many such connections."""
    low, high = _listening_ports(count)
    while True:
        port = random.randrange(low, high)
        if all(_port_free(host, port + i) for i in range(count)):
            return port


def _listening_ports(count: int) -> tuple[int, int]:
    """[low, high): where free_tcp_port draws a block of `count` ports."""
    try:
        first, last = map(int, _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        first, last = 49152, 65535  # IANA's dynamic range, which most other kernels use
    if first - count > _FIRST_LISTENING_PORT + 1000:
        return _FIRST_LISTENING_PORT, first - count + 1
    if 65536 - count > last + 1000:
        return last + 1, 65536 - count
    return 1024, 65536 - count  # the ephemeral range leaves no room: take the risk


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
        path = f"{address[len('ipc://') :]}-{role}"
        if len(path.encode()) > zmq.IPC_PATH_MAX_LEN:
            raise ValueError(
                f"the socket path {path!r} is longer than the {zmq.IPC_PATH_MAX_LEN} bytes "
                "a unix socket's path may have"
            )
        return f"ipc://{path}"
    if address.startswith("tcp://"):
        host, port = address[len("tcp://") :].rsplit(":", 1)
        return f"tcp://{host}:{int(port) + index}"
    raise ValueError(f"engine address must start with ipc:// or tcp://, got {address!r}")


def ipc_paths(address: str) -> list[Path]:
    """The socket files an ipc:// engine address creates (empty for tcp)."""
    if not address.startswith("ipc://"):
        return []
    return [Path(socket_address(address, role)[len("ipc://") :]) for role in _ROLES]


def private_folder(address: str) -> Path | None:
    """The 0700 folder new_ipc_address made for `address` (None for any other address).
    Other private files of the cluster may go there; remove_ipc_files removes them."""
    paths = ipc_paths(address)
    if paths and paths[0].parent.name.startswith("splitserve-"):
        return paths[0].parent
    return None


def remove_ipc_files(address: str) -> None:
    """Remove the socket files, and the folder new_ipc_address made for them."""
    for path in ipc_paths(address):
        path.unlink(missing_ok=True)
    folder = private_folder(address)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def make_socket(
    ctx: zmq.Context,
    kind: int,
    address: str,
    bind: bool,
    identity: bytes | None = None,
    credentials: Credentials | None = None,
    role: str | None = None,
    monitor: int = 0,
    hwm: int = HWM,
) -> zmq.Socket:
    """A bounded socket bound to (or connected to) exactly `address`. On tcp it speaks
    CURVE: bound, as the server for peers of `role` (the context must be an
    ipc.auth.AuthContext); connected, as `role`. `monitor`: the events to watch from
    the start (`sock.get_monitor_socket()` then returns the watching socket)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if bind:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if address.startswith("tcp://"):
        if credentials is None or role is None:
            sock.close()
            raise ValueError(f"tcp sockets need credentials and a role: {address}")
        secure_socket(sock, credentials, role, server=bind)
    if monitor:
        sock.get_monitor_socket(monitor)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def client_sockets(
    input_ctx: zmq.Context,
    output_ctx: zmq.Context,
    address: str,
    identity: bytes,
    credentials: Credentials | None,
    monitor: int,
) -> tuple[zmq.Socket, zmq.Socket]:
    """A client's input and output DEALERs, one identity; the output one monitored."""
    return tuple(
        make_socket(
            ctx,
            zmq.DEALER,
            socket_address(address, role),
            False,
            identity,
            credentials,
            CLIENT,
            monitor if role == "output" else 0,
            CLIENT_HWM,
        )
        for ctx, role in ((input_ctx, "input"), (output_ctx, "output"))
    )


def write_address_file(path: str | os.PathLike, address: str) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(address + "\n")
    tmp.replace(path)


def read_address(address_or_file: str) -> str:
    """Accept an engine address or the path of a file that holds one."""
    if address_or_file.startswith(("ipc://", "tcp://")):
        return address_or_file
    return Path(address_or_file).read_text().strip()
