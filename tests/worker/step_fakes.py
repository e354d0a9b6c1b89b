"""Stand-in launch/finish for the step pipeline and the step thread: they log their calls,
launched steps report `done`, launching a step in `fail_launch` or finishing one in
`fail_finish` raises, and launching step `hold` waits for `release`."""

import gc
import threading
import time
import weakref
from dataclasses import dataclass

from ipc.messages import CachedRequestData, SchedulerOutput


@dataclass
class Launched:
    step_id: int
    is_done: bool
    idle_before: float = 0.0

    def done(self):
        return self.is_done


class Steps:
    def __init__(self, done=False, fail_launch=(), fail_finish=(), hold=None):
        self.log = []
        self.done, self.fail_launch, self.fail_finish = done, fail_launch, fail_finish
        self.hold = hold
        self.entered, self.release = threading.Event(), threading.Event()

    def launch(self, scheduler_output):
        step_id = scheduler_output.step_id
        if step_id == self.hold:
            self.entered.set()
            assert self.release.wait(5)
        if step_id in self.fail_launch:
            raise ValueError(f"launch {step_id} failed")
        self.log.append(("launch", step_id))
        return Launched(step_id, self.done)

    def finish(self, launched):
        if launched.step_id in self.fail_finish:
            raise ValueError(f"finish {launched.step_id} failed")
        self.log.append(("finish", launched.step_id))
        return 10 * launched.step_id


def step(step_id: int, lockstep: bool = False) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], CachedRequestData(), {}, 0, lockstep=lockstep)


def wait_until_collected(refs: list[weakref.ref], timeout: float = 10.0) -> None:
    """Collect garbage until every referent is gone: a step thread may hold a step's
    owner a moment after answering its last step."""
    deadline = time.monotonic() + timeout
    gc.collect()
    while any(ref() is not None for ref in refs):
        assert time.monotonic() < deadline, "still alive after the step thread was dropped"
        time.sleep(0.01)
        gc.collect()
