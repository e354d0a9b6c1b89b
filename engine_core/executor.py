"""The executor: what the EngineCore needs from whatever runs the model."""

from abc import ABC, abstractmethod

from ipc.messages import ModelRunnerOutput, SchedulerOutput


class WorkerFailure(RuntimeError):
    """A worker reported an error, died or missed its deadline: the workers can run no
    more steps until they are replaced."""


class Executor(ABC):
    # (called, sent, answered) perf_counter times of the last execute_model that ran the
    # model; StepProfile reads and clears it. None when the executor does not time calls.
    last_call: tuple[float, float, float] | None = None
    # Seconds rank 0 waited for that step with its device idle (ModelRunnerOutput).
    last_worker_idle: float = 0.0
    # Each KV cache group's sliding window (None: full attention), in the order block ids
    # travel in; set by determine_num_blocks.
    kv_cache_groups: list[int | None] = [None]
    # The workers' device type, "cuda" only when every rank runs on CUDA: then a submitted
    # step runs while this process goes on, so async scheduling helps. It also picks the
    # default token budget (EngineConfig.token_budget). Set by determine_num_blocks.
    device_type: str = "cpu"
    # The KV host tier (config.kv_offload_memory; 0 blocks: off) and the workers' measured
    # seconds to copy one block one way and to prefill one token; set by
    # determine_num_blocks.
    num_host_blocks: int = 0
    block_copy_seconds: float = 0.0
    prefill_token_seconds: float = 0.0

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """Number of KV cache blocks every worker holds (the minimum over ranks). Workers
        allocate the cache themselves, so they apply config.num_gpu_blocks_override.
        Also sets num_host_blocks and the measured costs."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers; the answer lists a (possibly empty) list of sampled
        tokens for each scheduled request. Raises WorkerFailure when the workers fail."""

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for its answer (async scheduling); collect() takes
        the answers in submission order. By default the step runs when it is collected."""
        return None

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The answer to the oldest submitted step, `scheduler_output`."""
        return self.execute_model(scheduler_output)

    def check_workers(self) -> None:
        """Between steps: raise WorkerFailure if a worker is gone or reported an error.
        Workers in the EngineCore's own process cannot be gone: nothing to check."""
        return None

    def replace_workers(self, num_blocks: int) -> None:
        """Start fresh workers with `num_blocks` empty KV blocks (and num_host_blocks empty
        host blocks), knowing no request."""
        raise WorkerFailure(f"{type(self).__name__} cannot replace its workers")

    @abstractmethod
    def shutdown(self) -> None: ...
