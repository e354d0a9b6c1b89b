"""When a worker launches and answers its steps: the policy both the worker process (steps
over ZMQ) and the in-process step thread (steps from a queue) follow.

A launched step is answered (finished: its samples copied to the host and reported)

* at once, when its SchedulerOutput says `lockstep`: the EngineCore waits for this answer
  before it schedules another step;
* before the next step is prepared, when it is done by the time that step arrives
  (always, off CUDA): answering it then delays nothing;
* else right after the next step is launched: the next step's decode rows are fed from
  its samples on the device, so the device goes on while the host finishes it;
* or when the EngineCore asks for it (FinishStep), having sent no later step.

    worker:  launch N+1 | finish N, answer N | (waits)            | launch N+2 | ...
    engine:                                  | update N, schedule |
                                             | N+2, send N+2      |
    device:  ... N      | N+1                                     | N+2
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ipc.messages import ModelRunnerOutput, SchedulerOutput
from worker.step_output import LaunchedStep

Launch = Callable[[SchedulerOutput], LaunchedStep]
Finish = Callable[[LaunchedStep], ModelRunnerOutput]
# Takes a step's id and its answer: its output, or what launching or finishing it raised.
Deliver = Callable[[int, ModelRunnerOutput | BaseException], None]

# While a launched step runs, a worker waiting for the next one looks this often (seconds)
# whether it is done: from then on the device is idle.
POLL_SECONDS = 0.001


class StepPipeline:
    """Launches the steps it is given in order and answers each by the policy above,
    handing every answer to `deliver` the moment it exists (an answer given before the
    next launch must not wait for that launch). Errors are answers too, so `deliver`
    decides whether one ends it (a worker process) or fails only its step (the in-process
    step thread)."""

    def __init__(self, launch: Launch, finish: Finish, deliver: Deliver) -> None:
        self._launch, self._finish, self._deliver = launch, finish, deliver
        self._unanswered: LaunchedStep | None = None  # at most one
        self._idle = IdleClock()

    def wait_timeout(self) -> float | None:
        """How long to wait for the next message before calling again: while the launched
        step runs, poll for its end (the device's idle time starts there)."""
        return POLL_SECONDS if self._idle.waiting(self._unanswered) else None

    def run(self, scheduler_output: SchedulerOutput) -> None:
        idle_before = self._idle.take()
        if self._unanswered is not None and self._unanswered.done():
            self._answer()
        try:
            launched = self._launch(scheduler_output)
        except BaseException as e:
            self._answer()
            self._deliver(scheduler_output.step_id, e)
            return
        launched.idle_before = idle_before
        self._answer()
        self._unanswered = launched
        if scheduler_output.lockstep:
            self._answer()

    def finish_step(self, step_id: int) -> None:
        """The EngineCore waits for step `step_id` and sent no later step: answer it now,
        unless it was answered already."""
        if self._unanswered is not None and self._unanswered.step_id == step_id:
            self._answer()

    def close(self) -> None:
        """Answer the step still unanswered, if any."""
        self._answer()

    def _answer(self) -> None:
        step, self._unanswered = self._unanswered, None
        if step is None:
            return
        try:
            answer = self._finish(step)
        except BaseException as e:
            answer = e
        self._deliver(step.step_id, answer)


class IdleClock:
    """How long a worker's device has had nothing to run while the worker waited for its
    next step. `waiting(unanswered)` before each wait starts the clock once the launched
    work is done (and says whether to keep polling for that); `take()` when a step
    arrives returns the idle seconds and stops it."""

    def __init__(self) -> None:
        self._since: float | None = None

    def waiting(self, unanswered: LaunchedStep | None) -> bool:
        if self._since is None and (unanswered is None or unanswered.done()):
            self._since = time.perf_counter()
        return self._since is None

    def take(self) -> float:
        since, self._since = self._since, None
        return 0.0 if since is None else time.perf_counter() - since
