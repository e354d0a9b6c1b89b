"""The thread that runs an in-process engine's steps (async scheduling).

Python runs one thread at a time, so the EngineCore's update and scheduling overlap the
GPU only while the step thread waits for it. The step thread therefore answers step N
only once step N+1, if already submitted, has been prepared and launched:

    step thread:  prepare+launch N+1 | answer N | wait for GPU N+1 | finish N+1 | ...
    EngineCore:                        update N, schedule N+2, submit | wait for N+1

Answering N first would set both threads' Python against each other while the GPU
idles. When nothing is queued as step N finishes, N is answered at once.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ipc.messages import ModelRunnerOutput, SchedulerOutput

RunStep = Callable[[SchedulerOutput, Callable[[], None]], ModelRunnerOutput]


class StepThread:
    """Runs `run_step(scheduler_output, on_launch)` for each submitted step, in order;
    run_step calls on_launch once the step's device work is queued and before it waits
    for it. `collect` returns the answers in submission order."""

    def __init__(self, run_step: RunStep, device: torch.device) -> None:
        self._run_step = run_step
        self._cuda_index = None
        if device.type == "cuda":
            self._cuda_index = torch.cuda.current_device() if device.index is None else device.index
        self._jobs: queue.SimpleQueue[tuple[SchedulerOutput, Future] | None] = queue.SimpleQueue()
        self._submitted: deque[Future] = deque()
        self._thread = threading.Thread(target=self._loop, name="splitserve-step", daemon=True)
        self._thread.start()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        future: Future = Future()
        self._submitted.append(future)
        self._jobs.put((scheduler_output, future))

    def collect(self) -> ModelRunnerOutput:
        return self._submitted.popleft().result()

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
        unanswered: list[tuple[Future, ModelRunnerOutput]] = []

        def answer() -> None:
            while unanswered:
                future, output = unanswered.pop()
                future.set_result(output)

        while True:
            try:
                job = self._jobs.get(block=not unanswered)
            except queue.Empty:
                answer()
                continue
            if job is None:
                answer()
                return
            scheduler_output, future = job
            try:
                output = self._run_step(scheduler_output, answer)
            except BaseException as e:
                answer()
                future.set_exception(e)
                continue
            answer()  # run_step may have ended before it launched anything
            unanswered.append((future, output))
