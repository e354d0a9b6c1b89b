"""The thread that runs an in-process engine's steps under async scheduling, pipelined.

Python runs one thread at a time, so the EngineCore's update and scheduling overlap the
GPU only while the step thread waits for it, and the GPU stays busy only if the next step
is queued before the last one ends. The step thread launches step N+1 (its decode rows
fed from step N's samples on the device) and only then finishes and answers step N:

    step thread:  launch N+1 | finish N, answer N | (blocked)          | launch N+2 | ...
    EngineCore:                                   | update N, schedule |
                                                  | N+2, submit N+2    |
    GPU:          ... N      | N+1                                     | N+2

A step already done when the next arrives (always, off CUDA) is answered first; a step
that nothing follows is finished when the EngineCore asks for its answer.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ipc.messages import ModelRunnerOutput, SchedulerOutput
from worker.step_output import POLL_SECONDS, IdleClock, LaunchedStep

Launch = Callable[[SchedulerOutput], LaunchedStep]
Finish = Callable[[LaunchedStep], ModelRunnerOutput]
# A submitted step, the answer a collect() waits for, or None: stop.
_Job = tuple[SchedulerOutput, Future] | Future | None


class StepThread:
    """Launches each submitted step in order, and finishes a step once the next one is
    launched or its answer is asked for. `collect` returns the answers in order."""

    def __init__(self, launch: Launch, finish: Finish, device: torch.device) -> None:
        self._launch, self._finish = launch, finish
        self._cuda_index = None
        if device.type == "cuda":
            self._cuda_index = torch.cuda.current_device() if device.index is None else device.index
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._submitted: deque[Future] = deque()
        self._thread = threading.Thread(target=self._loop, name="splitserve-step", daemon=True)
        self._thread.start()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        future: Future = Future()
        self._submitted.append(future)
        self._jobs.put((scheduler_output, future))

    def collect(self) -> ModelRunnerOutput:
        future = self._submitted.popleft()
        if not future.done():
            self._jobs.put(future)  # finish it if no later step is launched first
        return future.result()

    def shutdown(self) -> None:
        """Stop the thread once the step it runs ends; steps not started are dropped."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        self._thread.join()
        self._submitted.clear()

    def _loop(self) -> None:
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)
        unfinished: list[tuple[LaunchedStep, Future]] = []  # at most one

        def answer() -> None:
            for step, future in unfinished:
                try:
                    future.set_result(self._finish(step))
                except BaseException as e:
                    future.set_exception(e)
            unfinished.clear()

        idle = IdleClock()
        while True:
            running = unfinished[0][0] if unfinished else None
            try:
                job = self._jobs.get(timeout=POLL_SECONDS if idle.waiting(running) else None)
            except queue.Empty:  # the launched step may be done by now
                continue
            if job is None:
                answer()
                return
            if isinstance(job, Future):
                if not job.done():
                    answer()
                continue
            scheduler_output, future = job
            idle_before = idle.take()
            if unfinished and unfinished[0][0].done():
                answer()
            try:
                step = self._launch(scheduler_output)
            except BaseException as e:
                answer()
                future.set_exception(e)
                continue
            step.idle_before = idle_before
            answer()
            unfinished.append((step, future))
