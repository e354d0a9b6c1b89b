from engine_core import EngineConfig
from engine_core.executor import Executor
from ipc.messages import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner


class InProcessExecutor(Executor):
    """One ModelRunner in the EngineCore's own process (tensor_parallel_size 1)."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    def determine_num_blocks(self) -> int:
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
