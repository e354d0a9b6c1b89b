"""The EngineCore process: an EngineCore over the worker processes, served on ZMQ.

Three threads: the input and output threads own the client sockets (client_io.py);
the main thread runs the busy loop: drain the input queue (blocking while there is no
work), step the EngineCore, send each output to the client that sent its request. A
worker failure replaces the workers and replays the running requests (see
`EngineCore.replace_workers`); past the restart bound every in-flight request fails and
the process exits with 1.

The first SIGTERM or SIGINT drains: new requests are refused, the running ones finish
(for up to `shutdown_timeout` seconds, then they are failed), and the process exits
with 0. A second signal stops it at once.

The process never imports torch: it schedules, and the workers own every tensor.
"""

from __future__ import annotations

import logging
import queue
import signal
import time
from collections.abc import Callable

from engine_core.client_io import ClientGone, ClientIO, error_outputs
from engine_core.core import EngineCore
from engine_core.multiproc_executor import MultiprocExecutor
from engine_core.spec_decode import spec_decode_summary
from engine_core.step_profile import StepProfile
from ipc.auth import Credentials
from ipc.config import EngineConfig
from ipc.executor import WorkerFailure
from ipc.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    UtilityOutput,
    UtilityRequest,
)
from ipc.sockets import remove_ipc_files

logger = logging.getLogger(__name__)

IDLE_CHECK_S = 1.0
STATS_INTERVAL_S = 5.0
_SHUTTING_DOWN = "the engine is shutting down"


class EngineShutdown(BaseException):
    """SIGTERM or SIGINT: raised in the main thread wherever it is."""


class EngineCoreProc:
    """`request_new_workers`: how to have the workers replaced after a failure (launch.py
    passes a call that asks its supervisor); None waits for new workers to register. A
    tcp `address` needs the cluster's `credentials` (ipc/auth.py)."""

    def __init__(
        self,
        config: EngineConfig,
        address: str,
        request_new_workers: Callable[[], None] | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.address = address
        self.executor = MultiprocExecutor(
            config, address, request_new_workers=request_new_workers, credentials=credentials
        )
        try:
            self.engine = EngineCore(config, self.executor)
        except BaseException:
            self.executor.shutdown()
            raise
        self.profile = StepProfile()
        self.owners: dict[str, bytes] = {}  # request_id -> identity of its client
        self._drain_deadline: float | None = None
        self._stats_window = (time.monotonic(), self.engine.get_stats())
        self.clients = ClientIO(address, credentials)

    def run(self) -> int:
        """The busy loop. Returns the exit code: 0 after a signal, 1 after a failure."""
        try:
            while not self._drained():
                busy = self.engine.has_unfinished_requests()
                self.profile.engine_was_idle |= not busy
                self._handle_input(block=not busy and self._drain_deadline is None)
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._maybe_log_stats()
            return 0
        except EngineShutdown as e:
            logger.info("%s: shutting down", e)
            self._fail_all(_SHUTTING_DOWN, ErrorCode.UNAVAILABLE)
            return 0
        except Exception as e:
            _ignore_signals()
            logger.error("EngineCore failed: %s", e, exc_info=not isinstance(e, WorkerFailure))
            self._fail_all("the engine failed and is stopping", ErrorCode.INTERNAL)
            return 1
        finally:
            self.close()

    def start_draining(self, reason: str) -> None:
        """Refuse new requests; let the running ones finish within shutdown_timeout."""
        timeout = self.engine.config.shutdown_timeout
        self._drain_deadline = time.monotonic() + timeout
        logger.info("%s: draining (new requests are refused; up to %g s)", reason, timeout)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def _drained(self) -> bool:
        if self._drain_deadline is None:
            return False
        if not self.engine.has_unfinished_requests():
            logger.info("drained: every request finished")
            return True
        if time.monotonic() < self._drain_deadline:
            return False
        logger.warning("shutdown timeout: failing the requests still running")
        self._fail_all(_SHUTTING_DOWN, ErrorCode.UNAVAILABLE)
        return True

    def close(self) -> None:
        self.clients.close()
        self.executor.shutdown()
        logger.info("step profile: %s", self.profile.summary())

    # busy loop

    def _handle_input(self, block: bool) -> None:
        if block:
            try:
                item = self.clients.input_queue.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                self.engine.check_workers()
                return
            self._stats_window = (time.monotonic(), self.engine.get_stats())
            self._handle(*item)
        while True:
            try:
                item = self.clients.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, identity: bytes, msg: object) -> None:
        if isinstance(msg, EngineCoreRequest):
            self._add_request(identity, msg)
        elif isinstance(msg, AbortRequests):
            own = [i for i in msg.request_ids if self.owners.get(i) == identity]
            self.engine.abort_requests(own)
        elif isinstance(msg, UtilityRequest):
            self.clients.send(identity, self._call_utility(msg))
        elif msg is ClientGone:
            own = [i for i, owner in self.owners.items() if owner == identity]
            for request_id in own:
                del self.owners[request_id]
            self.engine.abort_requests(own)
            if own:
                logger.warning("aborted %d request(s) of a client that is gone", len(own))
        else:  # an answer the input thread prepared for a bad frame
            self.clients.send(identity, msg)

    def _add_request(self, identity: bytes, request: EngineCoreRequest) -> None:
        request_id = request.request_id
        if self.draining:
            refusal = error_outputs([request_id], _SHUTTING_DOWN, ErrorCode.UNAVAILABLE)
            self.clients.send(identity, refusal)
            return
        if request_id in self.owners:
            error = f"request id {request_id!r} is in use"
            self.clients.send(identity, error_outputs([request_id], error))
            return
        self.owners[request_id] = identity
        try:
            self.engine.add_request(request)
        except Exception as e:
            del self.owners[request_id]
            logger.warning("refused request %r: %s", request_id, e)
            self.clients.send(identity, error_outputs([request_id], f"invalid request: {e}"))

    def _call_utility(self, call: UtilityRequest) -> UtilityOutput:
        if call.method == "stats":
            return UtilityOutput(call.call_id, self.profile.apply(self.engine.get_stats()))
        if call.method == "reset_prefix_cache":
            return UtilityOutput(call.call_id, self.engine.reset_prefix_cache())
        if call.method == "health":
            self.engine.check_workers()
            return UtilityOutput(call.call_id, not self.draining)
        return UtilityOutput(
            call.call_id,
            error=f"unknown utility method {call.method!r} (stats, reset_prefix_cache, health)",
        )

    def _step(self) -> None:
        outputs = self.profile.timed_step(self.engine.step, self.executor).outputs
        batches: dict[bytes, list[EngineCoreOutput]] = {}
        owners = self.owners
        for out in outputs:
            if out.finish_reason is None:
                owner = owners.get(out.request_id)
            else:
                owner = owners.pop(out.request_id, None)
            if owner is not None:
                batches.setdefault(owner, []).append(out)
        if batches:
            self.clients.send_many(
                [(owner, EngineCoreOutputs(outs)) for owner, outs in batches.items()]
            )

    def _fail_all(self, error: str, code: ErrorCode) -> None:
        """Finish every in-flight request, and every request still queued, with the error."""
        by_client: dict[bytes, list[str]] = {}
        for request_id, owner in self.owners.items():
            by_client.setdefault(owner, []).append(request_id)
        self.owners.clear()
        replies = [(owner, error_outputs(ids, error, code)) for owner, ids in by_client.items()]
        while True:
            try:
                identity, msg = self.clients.input_queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, EngineCoreRequest):
                replies.append((identity, error_outputs([msg.request_id], error, code)))
            elif isinstance(msg, UtilityRequest):
                replies.append((identity, UtilityOutput(msg.call_id, error=error)))
        if replies:
            self.clients.send_many(replies)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        since, before = self._stats_window
        if now - since < STATS_INTERVAL_S:
            return
        stats = self.engine.get_stats()
        elapsed = now - since
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        hits = stats.prefix_cache_hits - before.prefix_cache_hits
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, "
            "KV cache %.1f%%, prefix cache hit rate %.1f%%",
            (stats.num_prompt_tokens - before.num_prompt_tokens) / elapsed,
            (stats.num_generation_tokens - before.num_generation_tokens) / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * hits / queries if queries else 0.0,
        )
        if self.engine.kv_cache_manager.has_host_tier:
            logger.info(
                "KV host tier: %d blocks swapped out, %d copied in, %d spilled; %d hit tokens",
                stats.num_swapped_out_blocks - before.num_swapped_out_blocks,
                stats.num_swapped_in_blocks - before.num_swapped_in_blocks,
                stats.num_spilled_blocks - before.num_spilled_blocks,
                stats.host_cache_hits - before.host_cache_hits,
            )
        if self.engine.config.speculative_config is not None:
            logger.info("speculative decoding: %s", spec_decode_summary(before, stats))
        self._stats_window = (now, stats)


def run_engine_core(
    config: EngineConfig,
    address: str,
    on_ready: Callable[[], None] | None = None,
    request_new_workers: Callable[[], None] | None = None,
    credentials: Credentials | None = None,
) -> int:
    """Run the EngineCore process's main until it drains after SIGTERM/SIGINT (0) or
    fails (1). `on_ready` runs once every worker is ready and the client sockets are
    bound; a tcp `address` needs the cluster's `credentials` (ipc/auth.py)."""
    proc: EngineCoreProc | None = None

    def on_signal(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if proc is None or proc.draining:
            _ignore_signals()
            raise EngineShutdown(name)
        proc.start_draining(name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        proc = EngineCoreProc(config, address, request_new_workers, credentials)
        logger.info(
            "EngineCore ready at %s: tp %d, %d KV blocks of %d tokens",
            address,
            config.tensor_parallel_size,
            proc.engine.worker_spec.num_kv_blocks,
            config.block_size,
        )
        if on_ready is not None:
            on_ready()
        return proc.run()
    except EngineShutdown:
        return 0
    except Exception as e:
        logger.error("EngineCore failed to start: %s", e)
        return 1
    finally:
        remove_ipc_files(address)


def _ignore_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
