"""The executor: what the EngineCore needs from whatever runs the model."""

from abc import ABC, abstractmethod

from ipc.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """Number of KV cache blocks every worker holds (the minimum over ranks). Workers
        allocate the cache themselves, so they apply config.num_gpu_blocks_override."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers; the answer lists a (possibly empty) list of sampled
        tokens for each scheduled request."""

    @abstractmethod
    def shutdown(self) -> None: ...
