"""KV pages between a producer's and a consumer's workers, rank to rank, over ZeroMQ with
CURVE: a PageServer thread on each producer rank, and `pull_pages` on a consumer rank.

A consumer asks for a transfer by id and key (PagePull); the server answers with a header
and one frame per KV cache tensor holding the named pages, as bytes. A transfer is served
once. An id the server does not know (yet: the producer's workers learn of a transfer a
step after its answer left) is answered "not yet", and the consumer asks again until its
time runs out; a wrong key gets the same answer, so keys cannot be probed.

The keys come from one credentials file (ipc/auth.py's format) that every producer and
consumer of a deployment shares: producers are the CURVE servers, consumers connect with
the client key pair. The file is made on first use, race-free between processes.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import zmq

from ipc.auth import CLIENT, AuthContext, Credentials, secure_socket

_POLL_MS = 100
_RETRY_S = 0.005


class PagePull(msgspec.Struct, array_like=True):
    transfer_id: str
    key: str
    first_block: int
    num_blocks: int  # per group


class PageHeader(msgspec.Struct, array_like=True, omit_defaults=True):
    """`status`: "ok" (a frame per tensor follows), "unknown" (ask again) or "error"."""

    status: str
    error: str = ""
    num_pages: int = 0  # per tensor


class PullFailed(RuntimeError):
    pass


@dataclass
class ServedTransfer:
    key: str
    block_ids: list[list[int]]
    deadline: float
    served: bool = False


def shared_credentials(path: Path) -> Credentials:
    """The credentials in `path`; made first if missing, by exactly one process when
    several start at once (the file is linked into place, which fails if it exists)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        Credentials.generate().save(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return Credentials.load(path)


def gather_pages(tensors: list[torch.Tensor], block_ids: list[int]) -> list[memoryview]:
    """Each tensor's pages at `block_ids`, as bytes on the host."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    frames = []
    for tensor in tensors:
        pages = tensor.view(torch.uint8).index_select(1, ids).cpu()
        frames.append(memoryview(pages.numpy()).cast("B"))
    return frames


def scatter_pages(tensors: list[torch.Tensor], block_ids: list[int], frames: list) -> None:
    """Write pulled pages into each tensor's `block_ids`. Raises PullFailed when the frames
    do not fit this cache."""
    if len(frames) != len(tensors):
        raise PullFailed(f"got pages of {len(frames)} KV tensors, this cache has {len(tensors)}")
    ids = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    for tensor, frame in zip(tensors, frames, strict=True):
        dest = tensor.view(torch.uint8)
        shape = (dest.shape[0], len(block_ids), *dest.shape[2:])
        if len(frame) != shape[0] * len(block_ids) * dest[0, 0].numel():
            raise PullFailed(
                f"got {len(frame)} bytes of pages, expected {shape[0] * len(block_ids)} pages "
                f"of {dest[0, 0].numel()} bytes: the producer's KV cache has another layout"
            )
        with warnings.catch_warnings():  # a read-only buffer, only read
            warnings.simplefilter("ignore")
            pages = torch.frombuffer(frame, dtype=torch.uint8).view(shape)
        dest.index_copy_(1, ids, pages.to(dest.device))


class PageServer:
    """Serves registered transfers from its own thread; `lock` is held while pages are
    read, so a transfer removed under it is never read again."""

    def __init__(
        self,
        address: str,
        tensors: list[torch.Tensor],
        credentials: Credentials,
        served: threading.Event,
    ) -> None:
        self.tensors = tensors
        self.lock = threading.Lock()
        self.transfers: dict[str, ServedTransfer] = {}
        self.served = served  # set whenever a transfer was served
        self._ctx = AuthContext(credentials)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        secure_socket(self._sock, credentials, CLIENT, server=True)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise RuntimeError(f"cannot serve KV pages on {address}: {e}") from None
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(PagePull)
        self._thread = threading.Thread(target=self._serve, name="kv-page-server", daemon=True)
        self._thread.start()

    def add(self, transfer_id: str, transfer: ServedTransfer) -> None:
        with self.lock:
            self.transfers[transfer_id] = transfer

    def remove(self, transfer_id: str) -> ServedTransfer | None:
        with self.lock:
            return self.transfers.pop(transfer_id, None)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            identity, *frames = self._sock.recv_multipart()
            header, pages = self._answer(frames)
            self._sock.send_multipart([identity, msgspec.msgpack.encode(header), *pages])
            if pages:
                self.served.set()

    def _answer(self, frames: list[bytes]) -> tuple[PageHeader, list[memoryview]]:
        try:
            pull = self._decoder.decode(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            return PageHeader("error", "not a page request"), []
        with self.lock:
            transfer = self.transfers.get(pull.transfer_id)
            if (
                transfer is None
                or transfer.served
                or not hmac.compare_digest(transfer.key.encode(), pull.key.encode())
            ):
                return PageHeader("unknown"), []
            end = pull.first_block + pull.num_blocks
            if pull.first_block < 0 or any(end > len(ids) for ids in transfer.block_ids):
                return PageHeader("error", "the pages asked for are not in the transfer"), []
            block_ids = [i for ids in transfer.block_ids for i in ids[pull.first_block : end]]
            pages = gather_pages(self.tensors, block_ids)
            transfer.served = True
        return PageHeader("ok", num_pages=len(block_ids)), pages

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()


def pull_pages(
    ctx: zmq.Context, address: str, credentials: Credentials, pull: PagePull, timeout: float
) -> list:
    """The pages of `pull` from the PageServer at `address`, one frame per tensor. Raises
    PullFailed on an error answer or when no pages came within `timeout` seconds."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    secure_socket(sock, credentials, CLIENT, server=False)
    deadline = time.monotonic() + timeout
    request = msgspec.msgpack.encode(pull)
    decoder = msgspec.msgpack.Decoder(PageHeader)
    try:
        sock.connect(address)
        while True:
            sock.send(request)
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(round(1e3 * left)):
                raise PullFailed(f"no pages from {address} within {timeout:g} s")
            header, *frames = sock.recv_multipart(copy=False)
            answer = decoder.decode(header.buffer)
            if answer.status == "ok":
                return [frame.buffer for frame in frames]
            if answer.status != "unknown":
                raise PullFailed(f"{address} answered: {answer.error}")
            time.sleep(_RETRY_S)
    finally:
        sock.close()
