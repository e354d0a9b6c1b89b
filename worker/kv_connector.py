"""The workers' half of a KV connector (vLLM's KVConnectorBase_V1 in its worker role),
and ZmqConnector's (the EngineCore's half: engine_core/kv_connector.py).

Each step the runner hands the connector the step's KVConnectorMetadata before the
forward (`start_load_kv`: note new sends and stop serving revoked ones, start new pulls,
write landed pulls into the KV cache), then asks it which transfers every rank has finished
(`get_finished`). The page server answers pulls from its own thread meanwhile.

Ranks agree on what is finished: every rank holds the same pending transfers in the same
order (they come from the same metadata and leave by the same agreement), so each step
with transfers pending all ranks add up their per-transfer states in one all-reduce over
the tensor-parallel group; a transfer is finished once every rank is done with it, and
failed if any rank failed it. Only then does the EngineCore free a producer's blocks or
schedule a consumer's request.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq

from ipc.config import EngineConfig
from ipc.kv_transfer import shared_credentials, transfer_secret
from ipc.messages import KVConnectorMetadata, KVConnectorOutput, KVRecv
from models.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from worker.kv_transport import PagePull, PageServer, pull_pages, scatter_pages

logger = logging.getLogger(__name__)

_PULL_THREADS = 4
_PENDING, _DONE, _FAILED = 0, 1, 2


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, tensors: list[torch.Tensor]) -> None:
        """The KV cache tensors (one per layer position, as the host tier sees them)."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Before the step's forward: act on the step's metadata."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the step's forward: the KV it saved is ready to be read."""

    @abstractmethod
    def get_finished(self, timeout: float = 0.0) -> KVConnectorOutput | None:
        """The transfers every rank finished (None: none pending); with `timeout`, first
        wait that long at most for one of this rank's to finish."""

    @abstractmethod
    def shutdown(self) -> None: ...


@dataclass
class _Recv:
    recv: KVRecv
    future: Future
    start: float
    state: int = _PENDING
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0


class ZmqConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        transfer = config.kv_transfer_config
        self.config = transfer
        self.device = device
        self.rank = get_tp_rank()
        self.pull_timeout = float(transfer.extra("pull_timeout_s"))
        self.credentials = shared_credentials(transfer.credentials_path)
        base_port = transfer.kv_port + config.data_parallel_rank * config.tensor_parallel_size
        self.engine = (transfer.engine_id, base_port)
        self.address = f"tcp://{transfer.kv_ip}:{base_port + self.rank}"
        self.tensors: list[torch.Tensor] = []
        self.server: PageServer | None = None
        self._ctx: zmq.Context | None = None
        self._pulls: ThreadPoolExecutor | None = None
        self._progress = threading.Event()
        # Request id -> transfer id (a send) or _Recv, in the order every rank added them.
        self.pending: dict[str, str | _Recv] = {}

    def register_kv_caches(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        if self.config.is_producer:
            secret = transfer_secret(self.credentials)
            self.server = PageServer(
                self.address, self.tensors, self.credentials, secret, self.engine, self._progress
            )
            logger.info("rank %d serves KV pages on %s", self.rank, self.address)
        if self.config.is_consumer:
            self._ctx = zmq.Context()
            self._pulls = ThreadPoolExecutor(_PULL_THREADS, thread_name_prefix="kv-pull")

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is not None:
            for transfer_id in metadata.revoked:  # before this step may reuse the blocks
                self.server.revoke(transfer_id)
            revoked = set(metadata.revoked)
            sends = [(r, e) for r, e in self.pending.items() if isinstance(e, str)]
            for request_id in [r for r, transfer_id in sends if transfer_id in revoked]:
                del self.pending[request_id]
            for send in metadata.sends:
                self.pending[send.request_id] = send.transfer_id
            for recv in metadata.recvs:
                self.pending[recv.request_id] = _Recv(
                    recv, self._start_pull(recv), time.monotonic()
                )
        for entry in self.pending.values():
            if isinstance(entry, _Recv) and entry.state == _PENDING and entry.future.done():
                self._land(entry)

    def _start_pull(self, recv: KVRecv) -> Future:
        num_blocks = len(recv.block_ids[0]) if recv.block_ids else 0
        pull = PagePull(
            recv.transfer_id,
            recv.key,
            recv.remote_block_ids,
            recv.expires,
            recv.first_block,
            num_blocks,
        )
        address = f"tcp://{recv.host}:{recv.port + self.rank}"
        future = self._pulls.submit(
            pull_pages, self._ctx, address, self.credentials, pull, self.pull_timeout
        )
        future.add_done_callback(lambda _: self._progress.set())
        return future

    def _land(self, entry: _Recv) -> None:
        """Write a finished pull's pages into the request's blocks (or note its failure)."""
        try:
            block_ids = [i for ids in entry.recv.block_ids for i in ids]
            frames = entry.future.result()
            scatter_pages(self.tensors, block_ids, frames)
            entry.state = _DONE
            entry.num_bytes = sum(len(frame) for frame in frames)
            entry.seconds = time.monotonic() - entry.start
        except Exception as e:
            entry.state, entry.error = _FAILED, f"rank {self.rank}: {e}"

    def wait_for_save(self) -> None:
        """The forward wrote the KV in place: the server reads it from the cache."""

    def get_finished(self, timeout: float = 0.0) -> KVConnectorOutput | None:
        if not self.pending:
            return None
        if timeout > 0 and not any(self._local_states()):
            self._progress.wait(timeout)
            self.start_load_kv(None)  # land what arrived meanwhile
        self._progress.clear()
        states = self._local_states()
        flags = torch.tensor([[s != _PENDING for s in states], [s == _FAILED for s in states]])
        num_done, num_failed = tp_all_reduce(flags.to(self.device, torch.int32)).tolist()
        output = KVConnectorOutput([], [], {})
        for request_id, entry, done, failed in zip(
            list(self.pending), list(self.pending.values()), num_done, num_failed, strict=True
        ):
            if done < get_tp_size():
                continue
            del self.pending[request_id]
            if not isinstance(entry, _Recv):
                output.finished_sending.append(request_id)
            elif failed:
                output.failed_recving[request_id] = entry.error or "another rank's pull failed"
            else:
                output.finished_recving.append(request_id)
                output.pulled_bytes += entry.num_bytes * get_tp_size()
                output.pull_seconds += entry.seconds
        return output

    def _local_states(self) -> list[int]:
        return [self._local_state(entry) for entry in self.pending.values()]

    def _local_state(self, entry: str | _Recv) -> int:
        if isinstance(entry, _Recv):
            return entry.state
        return _DONE if self.server.was_served(entry) else _PENDING

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)
            self._ctx.destroy(linger=0)


def make_kv_connector(config: EngineConfig, device: torch.device) -> KVConnectorWorker | None:
    if config.kv_transfer_config is None:
        return None
    return ZmqConnectorWorker(config, device)
