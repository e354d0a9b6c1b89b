"""The executor contract: what the EngineCore needs from whatever runs the model.

It lives in ipc, beside the messages it carries, so that both sides implement it without
importing each other (DESIGN §2): engine_core's MultiprocExecutor drives worker processes
over ZMQ, worker's InProcessExecutor runs a ModelRunner in the EngineCore's own process.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ipc.messages import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerGroupSpec:
    """What the EngineCore learns of its workers once their KV caches exist.

    `kv_cache_groups` holds each KV cache group's sliding window (None: full attention),
    in the order block ids travel in. `device_type` is "cuda" only when every rank runs on
    CUDA: then a submitted step runs while the EngineCore goes on, so async scheduling
    helps; it also picks the default token budget (EngineConfig.token_budget).
    `worker_processes`: the ranks run in processes of their own (not in the EngineCore's),
    so a CPU step too runs while the EngineCore goes on. The host
    tier has `num_host_blocks` blocks (0: off); the costs are the workers' measured seconds
    to copy one block one way between the tiers and to prefill one token."""

    num_kv_blocks: int
    kv_cache_groups: tuple[int | None, ...] = (None,)
    num_host_blocks: int = 0
    block_copy_seconds: float = 0.0
    prefill_token_seconds: float = 0.0
    device_type: str = "cpu"
    worker_processes: bool = False


class WorkerFailure(RuntimeError):
    """A worker reported an error, died or missed its deadline: the workers can run no
    more steps until they are replaced."""


class Executor(ABC):
    # (called, sent, answered) perf_counter times of the last execute_model that ran the
    # model; StepProfile reads and clears it. None when the executor does not time calls.
    last_call: tuple[float, float, float] | None = None
    # Seconds rank 0 waited for that step with its device idle (ModelRunnerOutput).
    last_worker_idle: float = 0.0

    @abstractmethod
    def initialize_workers(self) -> WorkerGroupSpec:
        """Wait until the workers are up, give every one the same KV cache (as many blocks
        as the smallest holds; workers apply config.num_gpu_blocks_override themselves)
        and describe the group."""

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

    def replace_workers(self, spec: WorkerGroupSpec) -> None:
        """Start fresh workers, knowing no request, with the empty KV cache `spec` (the
        group's in use) describes; raise WorkerFailure if they cannot hold it."""
        raise WorkerFailure(f"{type(self).__name__} cannot replace its workers")

    @abstractmethod
    def shutdown(self) -> None: ...
