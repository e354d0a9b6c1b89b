"""EngineCore: the scheduler, the KV cache manager and an executor, stepped in-process."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable

from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from ipc.config import EngineConfig
from ipc.executor import Executor, WorkerFailure
from ipc.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerOutput, SchedulerStats
from kv_cache import KVCacheManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.executor = executor
        try:
            self.worker_spec = spec = executor.initialize_workers()
        except BaseException:
            executor.shutdown()
            raise
        budget = config.token_budget(spec.device_type)  # the workers' device is known now
        self.config = config = dataclasses.replace(config, max_num_batched_tokens=budget)
        self.kv_cache_manager = KVCacheManager(
            spec.num_kv_blocks,
            config.block_size,
            config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            group_windows=spec.kv_cache_groups,
            num_host_blocks=spec.num_host_blocks,
        )
        self.scheduler = Scheduler(
            config, self.kv_cache_manager, spec.block_copy_seconds, spec.prefill_token_seconds
        )
        self.num_worker_restarts = 0
        self._restart_times: deque[float] = deque()
        overlap = config.async_scheduling
        if overlap is None:
            # A GPU step, or a step in worker processes, runs while this process goes on
            # (on 2 CPU cores: one stream 11% and 32 streams 10% faster through the HTTP
            # server). In this process a CPU step holds the GIL and these cores.
            overlap = spec.device_type == "cuda" or spec.worker_processes
        # Steps sent and not yet answered; async scheduling leaves one in flight.
        self.in_flight: deque[SchedulerOutput] = deque()
        self.max_in_flight = 1 if overlap else 0

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never run gets an error output from the next step."""
        self.scheduler.add_request(
            Request.from_engine_core_request(request, self.config.eos_token_ids)
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule a step and send it, then take the answer of the oldest step in flight.
        With async scheduling the newest step stays in flight: the workers run step N+1
        while this process updates from step N and schedules N+2. Without it, or while a
        structured-output request needs its grammar advanced first, each step is answered
        before the next is scheduled; so is a step that verifies drafts. When the workers
        fail, they are replaced and the running requests replayed (this step then has no
        model output)."""
        if not self.max_in_flight:
            return self._step_in_lockstep()
        in_flight = self.in_flight
        try:
            if in_flight and (in_flight[-1].lockstep or self.scheduler.needs_lockstep):
                return self._collect()
            so = self.scheduler.schedule()
            so.lockstep = (
                self.scheduler.needs_lockstep
                or bool(so.scheduled_spec_decode_tokens)
                or so.propose_drafts
            )
            if _runs(so):
                self.executor.submit(so)
                in_flight.append(so)
            if len(in_flight) > self.max_in_flight or (in_flight and in_flight[-1] is not so):
                return self._collect()
        except WorkerFailure as e:
            self.replace_workers(e)
        return EngineCoreOutputs(self.scheduler.take_pending_outputs())

    def _step_in_lockstep(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        if not _runs(scheduler_output):
            return EngineCoreOutputs(self.scheduler.take_pending_outputs())
        scheduler_output.lockstep = True
        try:
            model_runner_output = self.executor.execute_model(scheduler_output)
        except WorkerFailure as e:
            self.replace_workers(e)
            return EngineCoreOutputs(self.scheduler.take_pending_outputs())
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def _collect(self) -> EngineCoreOutputs:
        scheduler_output = self.in_flight.popleft()
        model_runner_output = self.executor.collect(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def check_workers(self) -> None:
        """Between steps: replace workers that died or reported an error."""
        try:
            self.executor.check_workers()
        except WorkerFailure as e:
            self.replace_workers(e)

    def replace_workers(self, failure: WorkerFailure) -> None:
        """Fresh workers with an empty KV cache; every running request goes back to the
        waiting queue to be recomputed from its tokens (nothing is streamed twice). Raises
        `failure` once max_worker_restarts restarts fall within worker_restart_window, or
        when the executor cannot replace its workers."""
        self.in_flight.clear()  # their answers died with the workers
        now = time.monotonic()
        window = self._restart_times
        while window and now - window[0] > self.config.worker_restart_window:
            window.popleft()
        while True:
            if len(window) >= self.config.max_worker_restarts:
                raise WorkerFailure(
                    f"{failure} (gave up after {len(window)} worker restart(s) within "
                    f"{self.config.worker_restart_window:g} s)"
                ) from failure
            window.append(time.monotonic())
            self.num_worker_restarts += 1
            num_replayed = self.scheduler.requeue_for_new_workers()
            logger.error(
                "%s; replacing the workers (restart %d) and replaying %d request(s)",
                failure,
                self.num_worker_restarts,
                num_replayed,
            )
            try:
                self.executor.replace_workers(self.worker_spec)
                return
            except WorkerFailure as e:
                failure = e

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.in_flight)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()


def _runs(scheduler_output: SchedulerOutput) -> bool:
    """Whether the workers have anything to do: tokens, blocks to swap out (a step whose
    requests were all preempted still copies theirs), or KV transfers to start or report."""
    so = scheduler_output
    return bool(so.total_num_scheduled_tokens or so.blocks_to_swap_out or so.kv_connector_metadata)
