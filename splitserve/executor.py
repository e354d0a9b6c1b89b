import gc
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine_core.executor import Executor
from ipc.config import EngineConfig
from ipc.messages import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner


class InProcessExecutor(Executor):
    """One ModelRunner in the EngineCore's own process (tensor_parallel_size 1). Submitted
    steps run on one thread of their own, so that scheduling the next step overlaps the
    forward (which releases the GIL in torch's kernels and while waiting for the GPU)."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner: ModelRunner | None = ModelRunner(config)
        self.overlaps_steps = self.runner.device.type == "cuda"
        self._thread: ThreadPoolExecutor | None = None
        self._submitted: deque[Future] = deque()

    def determine_num_blocks(self) -> int:
        runner = self._runner()
        num_blocks = runner.determine_num_blocks()
        self.num_host_blocks = runner.determine_num_host_blocks()
        runner.initialize_kv_cache(num_blocks, self.num_host_blocks)
        runner.capture_cuda_graphs()
        self.kv_cache_groups = [group.sliding_window for group in runner.kv_cache_groups]
        self.block_copy_seconds = runner.block_copy_seconds
        self.prefill_token_seconds = runner.prefill_token_seconds
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self._runner().execute_model(scheduler_output)
        self.last_call = (start, start, time.perf_counter())  # nothing is sent: no broadcast
        return output

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        if self._thread is None:
            on_cuda = self._runner().device.type == "cuda"
            self._thread = ThreadPoolExecutor(
                1,
                thread_name_prefix="splitserve-step",
                initializer=torch.cuda.set_device if on_cuda else None,
                initargs=(torch.cuda.current_device(),) if on_cuda else (),
            )
        self._submitted.append(self._thread.submit(self.execute_model, scheduler_output))

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._submitted.popleft().result()

    def shutdown(self) -> None:
        """Drop the runner: its model, KV cache and CUDA graphs are freed, and on CUDA the
        cached memory goes back to the device, so a new engine in this process finds it."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None
        self._submitted.clear()
        if self.runner is None:
            return
        on_cuda = self.runner.device.type == "cuda"
        self.runner = None
        if on_cuda:
            gc.collect()
            torch.cuda.empty_cache()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the executor was shut down")
        return self.runner
