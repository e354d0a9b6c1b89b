import gc
import time

import torch

from ipc.config import EngineConfig
from ipc.executor import Executor, WorkerGroupSpec
from ipc.messages import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner
from worker.step_thread import StepThread


class InProcessExecutor(Executor):
    """One ModelRunner in the EngineCore's own process (tensor_parallel_size 1). Submitted
    steps run pipelined on a StepThread, so that the EngineCore's update and scheduling and
    the next step's preparation overlap the GPU's work."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner: ModelRunner | None = ModelRunner(config)
        self._steps: StepThread | None = None
        self._last_end: float | None = None  # when the last lockstep step ended

    def initialize_workers(self) -> WorkerGroupSpec:
        runner = self._runner()
        num_blocks = runner.determine_num_blocks()
        num_host_blocks = runner.determine_num_host_blocks()
        runner.initialize_kv_cache(num_blocks, num_host_blocks)
        runner.capture_cuda_graphs()
        return WorkerGroupSpec(
            num_blocks,
            tuple(group.sliding_window for group in runner.kv_cache_groups),
            num_host_blocks,
            runner.block_copy_seconds,
            runner.prefill_token_seconds,
            runner.device.type,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self._runner().execute_model(scheduler_output)
        end = time.perf_counter()
        self.last_call = (start, start, end)  # nothing is sent: no broadcast
        self.last_worker_idle = 0.0 if self._last_end is None else start - self._last_end
        self._last_end = end
        return output

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        if self._steps is None:
            runner = self._runner()
            self._steps = StepThread(runner.launch, runner.finish, runner.device)
        self._steps.submit(scheduler_output)

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._steps is None:
            raise RuntimeError("collect() before any submit()")
        start = time.perf_counter()
        output = self._steps.collect()
        self.last_call = (start, start, time.perf_counter())
        self.last_worker_idle = output.worker_idle_time
        return output

    def shutdown(self) -> None:
        """Drop the runner: its model, KV cache and CUDA graphs are freed, and on CUDA the
        cached memory goes back to the device, so a new engine in this process finds it."""
        if self._steps is not None:
            self._steps.shutdown()
            self._steps = None
        if self.runner is None:
            return
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()
        self.runner.kv_fault_in.stop()
        on_cuda = self.runner.device.type == "cuda"
        self.runner = None
        if on_cuda:
            gc.collect()
            torch.cuda.empty_cache()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the executor was shut down")
        return self.runner
