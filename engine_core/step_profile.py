import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from engine_core.executor import Executor
from ipc.messages import SchedulerStats

T = TypeVar("T")


@dataclass
class StepProfile:
    """Cumulative seconds of the steps that ran the model, by phase."""

    num_steps: int = 0
    schedule: float = 0.0
    broadcast: float = 0.0
    wait: float = 0.0
    update: float = 0.0

    def add(self, start: float, call: tuple[float, float, float], end: float) -> None:
        called, sent, answered = call
        self.num_steps += 1
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
            self.add(start, executor.last_call, end)
        return result

    def apply(self, stats: SchedulerStats) -> SchedulerStats:
        return msgspec.structs.replace(
            stats,
            num_steps=self.num_steps,
            schedule_time=self.schedule,
            broadcast_time=self.broadcast,
            wait_time=self.wait,
            update_time=self.update,
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
        return f"{self.num_steps} steps; per step: {phases}; EngineCore share {share:.1f}%"
