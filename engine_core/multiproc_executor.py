"""MultiprocExecutor: the EngineCore's side of the worker processes.

It owns the workers ROUTER of the engine address. Each worker connects a DEALER,
registers and gets its KV cache (worker_handshake.py). A step encodes the SchedulerOutput
once, sends the same bytes to every rank and waits for rank 0's ModelRunnerOutput. A
WorkerError from any rank, or a worker process that is gone, raises WorkerFailure naming
the rank (worker_liveness.py): the wait polls with a short timeout and checks the workers'
pids (on this host), so it never hangs on a dead worker.

Once the workers registered, frames from any other identity are dropped with a log line:
a stranger on the workers socket can neither end the cluster nor answer a step. On tcp the
socket admits only peers holding the workers' CURVE key (ipc/auth.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import NoReturn

import msgspec
import zmq

from engine_core.worker_handshake import (
    WorkerInfo,
    await_kv_caches,
    check_replacements,
    group_spec,
    register_workers,
)
from engine_core.worker_liveness import dead_worker, diagnose
from ipc.auth import WORKER, Credentials, engine_context
from ipc.config import EngineConfig
from ipc.executor import Executor, WorkerFailure, WorkerGroupSpec
from ipc.messages import (
    FROM_WORKERS,
    DecodeError,
    Decoder,
    FinishStep,
    InitKVCache,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    encode,
)
from ipc.sockets import make_socket, remove_ipc_files, socket_address

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
_POLL_MS = 100
_SHUTDOWN_GRACE_S = 5.0
_MAX_STRANGERS_LOGGED = 64


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
        self._decoder = Decoder(*FROM_WORKERS)
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

    def initialize_workers(self) -> WorkerGroupSpec:
        self.workers.extend(
            register_workers(self._receive, self.world_size, self.address, self.ready_timeout)
        )
        spec = group_spec(self.workers, self.config.num_gpu_blocks_override)
        self._init_kv_caches(spec)
        logger.info(
            "%d worker(s) ready (KV blocks per rank: %s; host blocks: %s); using %d and %d",
            self.world_size,
            [w.ready.num_kv_blocks for w in self.workers],
            [w.ready.num_host_blocks for w in self.workers],
            spec.num_kv_blocks,
            spec.num_host_blocks,
        )
        return spec

    def replace_workers(self, spec: WorkerGroupSpec) -> None:
        """Stop the group, have fresh workers started (same ranks, a new process group)
        and give them the KV cache in use."""
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
        self.workers.extend(
            register_workers(self._receive, self.world_size, self.address, self.ready_timeout)
        )
        check_replacements(self.workers, spec)
        self._init_kv_caches(spec)
        logger.info("%d new worker(s) ready", self.world_size)

    def _init_kv_caches(self, spec: WorkerGroupSpec) -> None:
        self._broadcast(encode(InitKVCache(spec.num_kv_blocks, spec.num_host_blocks)))
        await_kv_caches(self._receive, self.workers, self.ready_timeout)

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
            self._receive()
        self._check_alive()

    def shutdown(self) -> None:
        self._closer()

    def _receive(self) -> tuple[bytes, msgspec.Struct] | None:
        """The next (identity, message) from a worker, or None after a poll interval with
        nothing to read (the workers' liveness is checked then) or an undecodable frame.
        A WorkerError fails."""
        if not self._socket.poll(_POLL_MS):
            self._check_alive()
            return None
        received = self._read()
        if received is not None and isinstance(received[1], WorkerError):
            self._fail(diagnose(received[1], self._dead_worker, self._more_errors))
        return received

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

    def _more_errors(self) -> set[int]:
        """The ranks of the WorkerErrors waiting on the socket (other messages are dropped:
        the workers failed)."""
        ranks = set()
        while self._socket.poll(0):
            received = self._read()
            if received is not None and isinstance(received[1], WorkerError):
                ranks.add(received[1].rank)
        return ranks

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
        return dead_worker(self._processes, self.workers, self._hostname, reported)

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
