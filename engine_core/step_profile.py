import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from ipc.executor import Executor
from ipc.messages import SchedulerStats

T = TypeVar("T")


@dataclass
class StepProfile:
    """Cumulative seconds of the steps that ran the model, by phase, and the seconds rank 0
    spent waiting for them with its device idle. Under async scheduling the EngineCore's
    phases overlap the workers' steps: its busy share then says how loaded it is, the
    workers' idle share how much of it the device still waits for."""

    num_steps: int = 0
    schedule: float = 0.0
    broadcast: float = 0.0
    wait: float = 0.0
    update: float = 0.0
    worker_idle: float = 0.0
    # The EngineCore waited for requests since the last step: the workers' wait for the
    # next one is no overhead, and is not counted.
    engine_was_idle: bool = False

    def add(
        self, start: float, call: tuple[float, float, float], end: float, worker_idle: float = 0.0
    ) -> None:
        called, sent, answered = call
        self.num_steps += 1
        self.worker_idle += worker_idle
        self.schedule += called - start
        self.broadcast += sent - called
        self.wait += answered - sent
        self.update += end - answered

    def timed_step(self, step: Callable[[], T], executor: Executor) -> T:
        """Run `step` (an EngineCore.step) and add its phases; the executor records
        `last_call` = (called, sent, answered) perf_counter times when the model ran."""
        executor.last_call = None
        start = time.perf_counter()
        result = step()
        end = time.perf_counter()
        if executor.last_call is not None:
            worker_idle = 0.0 if self.engine_was_idle else executor.last_worker_idle
            self.add(start, executor.last_call, end, worker_idle)
            self.engine_was_idle = False
        return result

    def apply(self, stats: SchedulerStats) -> SchedulerStats:
        return msgspec.structs.replace(
            stats,
            num_steps=self.num_steps,
            schedule_time=self.schedule,
            broadcast_time=self.broadcast,
            wait_time=self.wait,
            update_time=self.update,
            worker_idle_time=self.worker_idle,
        )

    def summary(self) -> str:
        total = self.schedule + self.broadcast + self.wait + self.update
        if not self.num_steps or total <= 0:
            return "no model steps"
        per_step = {
            name: 1e3 * getattr(self, name) / self.num_steps
            for name in ("schedule", "broadcast", "wait", "update")
        }
        phases = ", ".join(f"{name} {ms:.3f} ms" for name, ms in per_step.items())
        share = 100 * (total - self.wait) / total
        idle = 100 * self.worker_idle / total
        return (
            f"{self.num_steps} steps; per step: {phases}; EngineCore share {share:.1f}% "
            f"(busy); rank 0 idle waiting for it {idle:.1f}%"
        )
