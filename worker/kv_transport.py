"""KV pages between a producer's and a consumer's workers, rank to rank, over ZeroMQ with
CURVE: a PageServer thread on each producer rank, and `pull_pages` on a consumer rank.

A consumer asks for a transfer (PagePull): its id, blocks, end time and key, and the
positions it wants. The server checks the key (an HMAC of the rest, ipc/kv_transfer.py)
and answers with a header and one frame per KV cache tensor holding the pages, as bytes;
so it serves a transfer the moment its answer reached the client, before the EngineCore's
next step tells the workers of it. A transfer is served once, and never after its end or
once the EngineCore revoked it (it may reuse the blocks from then on). Every refusal reads
the same, so nothing can be learnt by probing.

The keys come from one credentials file (ipc/auth.py's format) that every producer and
consumer of a deployment shares: producers are the CURVE servers, consumers connect with
the client key pair.
"""

from __future__ import annotations

import hmac
import threading
import time
import warnings

import msgspec
import torch
import zmq

from ipc.auth import CLIENT, AuthContext, Credentials, secure_socket
from ipc.kv_transfer import transfer_key

_POLL_MS = 100
_REVOKED_KEPT_S = 3600.0  # longer than the hosts' clocks ever differ
REFUSED = "refused: unknown, expired or already served transfer, or a wrong key"


class PagePull(msgspec.Struct, array_like=True):
    transfer_id: str
    key: str
    block_ids: list[list[int]]  # the transfer's, per group
    expires: float
    first_block: int
    num_blocks: int  # per group


class PageHeader(msgspec.Struct, array_like=True, omit_defaults=True):
    """`status` "ok": a frame per tensor follows; else `error` says why not."""

    status: str
    error: str = ""
    num_pages: int = 0  # per tensor


class PullFailed(RuntimeError):
    pass


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
    """Serves pulls from its own thread. `lock` is held while pages are read and while a
    transfer is revoked, so a revoked transfer's blocks are never read again. `served`
    (transfer id -> end) and `revoked` forget a transfer once its end has passed."""

    def __init__(
        self,
        address: str,
        tensors: list[torch.Tensor],
        credentials: Credentials,
        secret: bytes,
        engine: tuple[str, int],
        on_served: threading.Event,
    ) -> None:
        self.tensors = tensors
        self.secret = secret
        self.engine = engine  # (engine id, base port): what the keys are bound to
        self.lock = threading.Lock()
        self.served: dict[str, float] = {}
        self.revoked: dict[str, float] = {}
        self.on_served = on_served
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

    def revoke(self, transfer_id: str) -> None:
        with self.lock:
            self.revoked[transfer_id] = time.time() + _REVOKED_KEPT_S
            self._forget_ended()

    def was_served(self, transfer_id: str) -> bool:
        with self.lock:
            return transfer_id in self.served

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            identity, *frames = self._sock.recv_multipart()
            header, pages = self._answer(frames)
            self._sock.send_multipart([identity, msgspec.msgpack.encode(header), *pages])
            if pages:
                self.on_served.set()

    def _answer(self, frames: list[bytes]) -> tuple[PageHeader, list[memoryview]]:
        try:
            pull = self._decoder.decode(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            return PageHeader("error", "not a page request"), []
        expected = transfer_key(
            self.secret, *self.engine, pull.transfer_id, pull.block_ids, pull.expires
        )
        with self.lock:
            if (
                not hmac.compare_digest(expected, pull.key)
                or pull.expires < time.time()
                or pull.transfer_id in self.served
                or pull.transfer_id in self.revoked
            ):
                return PageHeader("error", REFUSED), []
            end = pull.first_block + pull.num_blocks
            if pull.first_block < 0 or any(end > len(ids) for ids in pull.block_ids):
                return PageHeader("error", "the pages asked for are not in the transfer"), []
            block_ids = [i for ids in pull.block_ids for i in ids[pull.first_block : end]]
            pages = gather_pages(self.tensors, block_ids)
            self.served[pull.transfer_id] = pull.expires
            self._forget_ended()
        return PageHeader("ok", num_pages=len(block_ids)), pages

    def _forget_ended(self) -> None:
        """A transfer past its end is refused by its key's end anyway."""
        now = time.time()
        for ended in (self.served, self.revoked):
            for transfer_id in [t for t, end in ended.items() if end < now]:
                del ended[transfer_id]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()


def pull_pages(
    ctx: zmq.Context, address: str, credentials: Credentials, pull: PagePull, timeout: float
) -> list:
    """The pages of `pull` from the PageServer at `address`, one frame per tensor. Raises
    PullFailed on a refusal or when no answer came within `timeout` seconds."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    secure_socket(sock, credentials, CLIENT, server=False)
    try:
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(pull))
        if not sock.poll(round(1e3 * timeout)):
            raise PullFailed(f"no pages from {address} within {timeout:g} s")
        header, *frames = sock.recv_multipart(copy=False)
        answer = msgspec.msgpack.decode(header.buffer, type=PageHeader)
        if answer.status != "ok":
            raise PullFailed(f"{address} answered: {answer.error}")
        return [frame.buffer for frame in frames]
    finally:
        sock.close()
