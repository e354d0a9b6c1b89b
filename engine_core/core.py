"""EngineCore: the scheduler, the KV cache manager and an executor, stepped in-process."""

from __future__ import annotations

from collections.abc import Iterable

from engine_core.config import EngineConfig
from engine_core.executor import Executor
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from ipc.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kv_cache import KVCacheManager


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.kv_cache_manager = KVCacheManager(
            executor.determine_num_blocks(),
            config.block_size,
            config.max_model_len,
            enable_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never run gets an error output from the next step."""
        self.scheduler.add_request(
            Request.from_engine_core_request(request, self.config.eos_token_ids)
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EngineCoreOutputs(self.scheduler.take_pending_outputs())
        model_runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
