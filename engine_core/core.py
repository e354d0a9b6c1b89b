"""EngineCore: the scheduler, the KV cache manager and an executor, stepped in-process."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from engine_core.executor import Executor, WorkerFailure
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from ipc.config import EngineConfig
from ipc.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kv_cache import KVCacheManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        try:
            self.num_blocks = executor.determine_num_blocks()
        except BaseException:
            executor.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            group_windows=executor.kv_cache_groups,
            num_host_blocks=executor.num_host_blocks,
        )
        self.scheduler = Scheduler(
            config,
            self.kv_cache_manager,
            executor.block_copy_seconds,
            executor.prefill_token_seconds,
        )
        self.num_worker_restarts = 0
        self._restart_times: deque[float] = deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never run gets an error output from the next step."""
        self.scheduler.add_request(
            Request.from_engine_core_request(request, self.config.eos_token_ids)
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule and run one step. When the workers fail, they are replaced and the
        running requests replayed (this step then has no model output)."""
        scheduler_output = self.scheduler.schedule()
        # A step that only swaps blocks out (its requests were all preempted) still runs.
        if not (scheduler_output.total_num_scheduled_tokens or scheduler_output.blocks_to_swap_out):
            return EngineCoreOutputs(self.scheduler.take_pending_outputs())
        try:
            model_runner_output = self.executor.execute_model(scheduler_output)
        except WorkerFailure as e:
            self.replace_workers(e)
            return EngineCoreOutputs(self.scheduler.take_pending_outputs())
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
                self.executor.replace_workers(self.num_blocks)
                return
            except WorkerFailure as e:
                failure = e

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
