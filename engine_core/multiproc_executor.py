"""MultiprocExecutor: the EngineCore's side of the worker processes.

It owns the workers ROUTER of the engine address. Each worker connects a DEALER and
registers with WorkerReady; every rank then gets InitKVCache with the smallest block
counts (device and host tier) and answers KVCacheReady once its cache exists. A step
encodes the SchedulerOutput once, sends the same bytes to every rank and waits for rank
0's ModelRunnerOutput. A WorkerError from any rank, or a worker process that is gone,
raises WorkerFailure naming the rank: the wait polls with a short timeout and checks the
workers' pids (on this host), so it never hangs on a dead worker.

Once the workers registered, frames from any other identity are dropped with a log line:
a stranger on the workers socket can neither end the cluster nor answer a step. On tcp the
socket admits only peers holding the workers' CURVE key (ipc/auth.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

import msgspec
import zmq

from engine_core.executor import Executor, WorkerFailure
from ipc.auth import WORKER, Credentials, engine_context
from ipc.config import EngineConfig
from ipc.messages import (
    DecodeError,
    Decoder,
    FinishStep,
    InitKVCache,
    KVCacheReady,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
    encode,
)
from ipc.sockets import make_socket, remove_ipc_files, socket_address

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
_POLL_MS = 100
_SHUTDOWN_GRACE_S = 5.0
_DEATH_GRACE_S = 0.5
_MAX_STRANGERS_LOGGED = 64


@dataclass
class WorkerInfo:
    rank: int
    identity: bytes
    num_kv_blocks: int
    pid: int
    hostname: str
    kv_cache_groups: list[int | None]
    num_host_blocks: int = 0
    block_copy_seconds: float = 0.0
    prefill_token_seconds: float = 0.0
    device_type: str = "cpu"


class MultiprocExecutor(Executor):
    """Who starts the workers decides how they are replaced after a failure:

    * `start_workers` (as `splitserve.LLM` does): the executor starts them itself, owns
      the processes (by rank), and on `replace_workers` kills and starts them again;
      shutdown stops them and removes the address's socket files.
    * `request_new_workers` (under launch.py, whose children they are): the executor
      asks the supervisor to kill and start them again.
    * neither (workers started by hand or by torchrun on other hosts): the executor
      tells the old ones to stop and waits for new ones to register.
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str,
        start_workers: Callable[[], Sequence[subprocess.Popen]] | None = None,
        request_new_workers: Callable[[], None] | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        credentials: Credentials | None = None,
    ) -> None:
        self.config = config
        self.address = address
        self.world_size = config.tensor_parallel_size
        self.ready_timeout = ready_timeout
        self.step_timeout = config.worker_step_timeout
        self.workers: list[WorkerInfo] = []
        # (start, sent, answered) perf_counter times of the last execute_model.
        self.last_call: tuple[float, float, float] | None = None
        # (start, sent) of the last submit, until a collect takes them; steps sent and not
        # yet answered.
        self._submitted: tuple[float, float] | None = None
        self._num_in_flight = 0
        self._start_workers = start_workers
        self._request_new_workers = request_new_workers
        self._processes: list[subprocess.Popen] = []
        self._hostname = socket.gethostname()
        self._decoder = Decoder(ModelRunnerOutput, WorkerError, WorkerReady, KVCacheReady)
        self._strangers: set[bytes] = set()
        self._replaced: set[bytes] = set()  # identities of workers replaced since
        self._ctx = engine_context(credentials)
        workers_address = socket_address(address, "workers")
        self._socket = make_socket(
            self._ctx, zmq.ROUTER, workers_address, True, credentials=credentials, role=WORKER
        )
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._closer = weakref.finalize(
            self, _close, self._ctx, self._socket, self.workers, self._processes, address
        )
        if start_workers is not None:
            self._processes.extend(start_workers())

    def determine_num_blocks(self) -> int:
        """Wait for every rank's WorkerReady, then tell all of them the smallest block
        counts (and num_gpu_blocks_override, if smaller). A step runs at the pace of the
        slowest rank, so the measured costs are the largest over the ranks."""
        self._register_workers()
        self.kv_cache_groups = self.workers[0].kv_cache_groups
        num_blocks = min(w.num_kv_blocks for w in self.workers)
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = min(num_blocks, self.config.num_gpu_blocks_override)
        self.num_host_blocks = min(w.num_host_blocks for w in self.workers)
        self.block_copy_seconds = max(w.block_copy_seconds for w in self.workers)
        self.prefill_token_seconds = max(w.prefill_token_seconds for w in self.workers)
        on_cuda = all(w.device_type == "cuda" for w in self.workers)
        self.device_type = "cuda" if on_cuda else "cpu"
        self._init_kv_caches(num_blocks)
        logger.info(
            "%d worker(s) ready (KV blocks per rank: %s; host blocks: %s); using %d and %d",
            self.world_size,
            [w.num_kv_blocks for w in self.workers],
            [w.num_host_blocks for w in self.workers],
            num_blocks,
            self.num_host_blocks,
        )
        return num_blocks

    def replace_workers(self, num_blocks: int) -> None:
        """Stop the group, have fresh workers started (same ranks, a new process group)
        and give them the same `num_blocks` and num_host_blocks. Raises WorkerFailure if
        they do not come or hold fewer blocks."""
        self._num_in_flight, self._submitted = 0, None  # the old workers' steps are lost
        frame = encode(Shutdown())
        for worker in self.workers:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send_multipart((worker.identity, frame), zmq.NOBLOCK)
        self._replaced.update(w.identity for w in self.workers)
        self.workers.clear()
        if self._start_workers is not None:
            for process in self._processes:
                process.kill()
                process.wait()
            self._processes[:] = self._start_workers()
        elif self._request_new_workers is not None:
            self._request_new_workers()
        self._register_workers()
        if self.workers[0].kv_cache_groups != self.kv_cache_groups:
            self._fail(
                f"the new workers' KV cache groups {self.workers[0].kv_cache_groups} differ "
                f"from those in use {self.kv_cache_groups}"
            )
        fits = min(w.num_kv_blocks for w in self.workers)
        if fits < num_blocks:
            self._fail(f"the new workers hold {fits} KV blocks, fewer than the {num_blocks} in use")
        fits = min(w.num_host_blocks for w in self.workers)
        if fits < self.num_host_blocks:
            self._fail(
                f"the new workers hold {fits} host KV blocks, fewer than the "
                f"{self.num_host_blocks} in use"
            )
        self._init_kv_caches(num_blocks)
        logger.info("%d new worker(s) ready", self.world_size)

    def _init_kv_caches(self, num_blocks: int) -> None:
        """Send every rank InitKVCache and wait for all their KVCacheReady: allocating
        the cache (and capturing CUDA graphs) takes seconds, which must not fall on the
        first step."""
        self._broadcast(encode(InitKVCache(num_blocks, self.num_host_blocks)))
        waiting = set(range(self.world_size))
        for identity, msg in self._handshake(
            lambda: sorted(waiting),
            lambda ranks: f"rank(s) {ranks} to allocate their KV cache",
        ):
            rank = next(w.rank for w in self.workers if w.identity == identity)
            if isinstance(msg, KVCacheReady) and msg.rank == rank:
                waiting.discard(rank)
            else:
                logger.warning(
                    "ignored %s from rank %d before KVCacheReady", type(msg).__name__, rank
                )

    def _handshake(
        self, pending: Callable[[], list[int]], waited_for: Callable[[list[int]], str]
    ) -> Iterator[tuple[bytes, msgspec.Struct]]:
        """The workers' (identity, message) until no rank is `pending()`. A WorkerError
        fails, and so does the ready timeout, naming what the pending ranks owe."""
        deadline = time.monotonic() + self.ready_timeout
        while missing := pending():
            if time.monotonic() > deadline:
                self._fail(
                    f"timed out after {self.ready_timeout:g} s waiting for " + waited_for(missing)
                )
            received = self._receive()
            if received is None:
                continue
            if isinstance(received[1], WorkerError):
                self._fail_with(received[1])
            yield received

    def _register_workers(self) -> None:
        ready: dict[int, WorkerInfo] = {}
        for identity, msg in self._handshake(
            lambda: sorted(set(range(self.world_size)) - set(ready)),
            lambda ranks: f"workers at {self.address}: no WorkerReady from rank(s) {ranks}",
        ):
            if not isinstance(msg, WorkerReady):
                logger.warning("ignored %s from a worker that is not ready", type(msg).__name__)
            elif not 0 <= msg.rank < self.world_size:
                self._fail(f"unexpected WorkerReady for rank {msg.rank} (tp={self.world_size})")
            elif msg.rank in ready or any(w.identity == identity for w in ready.values()):
                logger.warning(
                    "ignored a second WorkerReady for rank %d (from %r)", msg.rank, identity
                )
            else:
                ready[msg.rank] = WorkerInfo(
                    msg.rank,
                    identity,
                    msg.num_kv_blocks,
                    msg.pid,
                    msg.hostname,
                    msg.kv_cache_groups,
                    msg.num_host_blocks,
                    msg.block_copy_seconds,
                    msg.prefill_token_seconds,
                    msg.device_type,
                )
        self.workers.extend(ready[rank] for rank in range(self.world_size))
        groups = {tuple(w.kv_cache_groups) for w in self.workers}
        if len(groups) > 1:
            self._fail(f"the ranks report different KV cache groups: {list(groups)}")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        start = time.perf_counter()
        self._broadcast(encode(scheduler_output))
        self._submitted = (start, time.perf_counter())
        self._num_in_flight += 1

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0 answers the steps in the order they were sent. Workers answer a step not
        sent in lockstep once they have launched the next, so with no later step sent they
        are told to answer this one now."""
        start, sent = self._submitted or (time.perf_counter(),) * 2
        self._submitted = None
        self._num_in_flight -= 1
        if not (self._num_in_flight or scheduler_output.lockstep):
            self._broadcast(encode(FinishStep(scheduler_output.step_id)))
        driver = self.workers[0].identity
        deadline = time.monotonic() + self.step_timeout
        while True:
            received = self._receive()
            if received is None:
                if time.monotonic() > deadline:
                    self._fail(
                        f"worker rank 0 did not answer step {scheduler_output.step_id} "
                        f"within {self.step_timeout:g} s"
                    )
                continue
            identity, msg = received
            if isinstance(msg, WorkerError):
                self._fail_with(msg)
            if isinstance(msg, ModelRunnerOutput) and identity == driver:
                if msg.step_id != scheduler_output.step_id:
                    self._fail(
                        f"worker rank 0 answered step {msg.step_id}, "
                        f"expected {scheduler_output.step_id}"
                    )
                self.last_call = (start, sent, time.perf_counter())
                self.last_worker_idle = msg.worker_idle_time
                return msg
            logger.warning("ignored %s from a worker during a step", type(msg).__name__)

    def check_workers(self) -> None:
        """Between steps: raise WorkerFailure if a worker reported an error or is gone.
        While a step is in flight its answer must stay queued: only liveness is checked."""
        while not self._num_in_flight and self._socket.poll(0):
            received = self._receive()
            if received is not None and isinstance(received[1], WorkerError):
                self._fail_with(received[1])
        self._check_alive()

    def shutdown(self) -> None:
        self._closer()

    def _receive(self) -> tuple[bytes, msgspec.Struct] | None:
        """The next (identity, message) from a worker, or None after a poll interval with
        nothing to read (the workers' liveness is checked then) or an undecodable frame."""
        if not self._socket.poll(_POLL_MS):
            self._check_alive()
            return None
        return self._read()

    def _read(self) -> tuple[bytes, msgspec.Struct] | None:
        identity, *frames = self._socket.recv_multipart()
        if identity in self._replaced:  # a late word from a worker that was replaced
            return None
        if self.workers and all(w.identity != identity for w in self.workers):
            self._drop_stranger(identity)
            return None
        try:
            if len(frames) != 1:
                raise DecodeError(f"expected one frame, got {len(frames)}")
            return identity, self._decoder.decode(frames[0])
        except DecodeError as e:
            logger.error("dropped a frame from worker %r: %s", identity, e)
            return None

    def _drop_stranger(self, identity: bytes) -> None:
        """Log once per identity (a flood of strangers is logged up to a bound)."""
        if identity not in self._strangers and len(self._strangers) < _MAX_STRANGERS_LOGGED:
            self._strangers.add(identity)
            logger.warning(
                "dropped a frame on the workers socket from %r, which is not a registered "
                "worker (further frames from it are dropped silently)",
                identity,
            )

    def _broadcast(self, frame: bytes) -> None:
        for worker in self.workers:
            try:
                self._socket.send_multipart((worker.identity, frame))
            except zmq.ZMQError as e:
                self._fail(f"worker rank {worker.rank} (pid {worker.pid}) is unreachable: {e}")

    def _check_alive(self) -> None:
        dead = self._dead_worker()
        if dead is not None:
            self._fail(dead)

    def _dead_worker(self, reported: Collection[int] = ()) -> str | None:
        """Describe a worker that is gone, other than the ranks that reported an error."""
        for rank, process in enumerate(self._processes):
            code = process.poll()
            if code is not None and rank not in reported:
                return f"worker rank {rank} (pid {process.pid}) died with exit code {code}"
        for worker in self.workers:
            if worker.rank in reported or worker.hostname != self._hostname:
                continue
            if not _pid_alive(worker.pid):
                return f"worker rank {worker.rank} (pid {worker.pid}) died"
        return None

    def _fail_with(self, error: WorkerError) -> NoReturn:
        """A rank's error is often a collective failing because another rank died: give
        a rank that died without a word a moment to show, and name it first."""
        reported = {error.rank}
        suspect = None
        deadline = time.monotonic() + _DEATH_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            while self._socket.poll(0):
                received = self._read()
                if received is not None and isinstance(received[1], WorkerError):
                    reported.add(received[1].rank)
            # Gone twice in a row with no error in between: it died without a word
            # (a rank that exits after its own WorkerError may show as gone first).
            dead = self._dead_worker(reported)
            if dead is not None and dead == suspect:
                last_line = error.message.strip().splitlines()[-1:] or [""]
                self._fail(f"{dead}; then worker rank {error.rank} failed: {last_line[0]}")
            suspect = dead
        step = "" if error.step_id is None else f" at step {error.step_id}"
        self._fail(f"worker rank {error.rank} failed{step}:\n{error.message}")

    def _fail(self, message: str) -> NoReturn:
        """The workers cannot step on (a step needs every rank): `replace_workers` or
        `shutdown` comes next."""
        raise WorkerFailure(message)


def _close(
    ctx: zmq.Context,
    sock: zmq.Socket,
    workers: list[WorkerInfo],
    processes: list[subprocess.Popen],
    address: str,
) -> None:
    """Send Shutdown to every worker; stop the processes we started if they linger."""
    frame = encode(Shutdown())
    for worker in workers:
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart((worker.identity, frame), zmq.NOBLOCK)
    deadline = time.monotonic() + _SHUTDOWN_GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    sock.close(linger=0 if processes else 1000)
    ctx.term()
    if processes:
        remove_ipc_files(address)


def _pid_alive(pid: int) -> bool:
    """False once the process has exited, even while it is an unreaped zombie (Linux)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
