"""The thread that runs an in-process engine's steps under async scheduling, pipelined as
worker/pipeline.py says.

Python runs one thread at a time, so the EngineCore's update and scheduling overlap the
GPU only while the step thread waits for it, and the GPU stays busy only if the next step
is queued before the last one ends: the step thread launches step N+1 and only then
finishes and answers step N, while the EngineCore thread waits for that answer.

The thread holds its pipeline (and with it the ModelRunner) only while it works on a
message, never while it waits: an LLM nobody references is collected with its model and
KV cache, and its StepThread's finalizer then stops the thread.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections import deque
from concurrent.futures import Future

import torch

from ipc.messages import FinishStep, ModelRunnerOutput, SchedulerOutput
from worker.pipeline import Finish, Launch, StepPipeline

# A submitted step and its answer's future, a request to answer a step now, or None: stop.
_Job = tuple[SchedulerOutput, Future] | FinishStep | None
_POLL = object()  # no job came within the wait: look whether the launched step is done


class StepThread:
    """Runs each submitted step in order on its own thread; `collect` returns the answers
    in order."""

    def __init__(self, launch: Launch, finish: Finish, device: torch.device) -> None:
        futures: dict[int, Future] = {}  # by step id, until answered
        self._pipeline = StepPipeline(launch, finish, functools.partial(_settle, futures))
        cuda_index = None
        if device.type == "cuda":
            cuda_index = torch.cuda.current_device() if device.index is None else device.index
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._submitted: deque[tuple[SchedulerOutput, Future]] = deque()
        self._thread = threading.Thread(
            target=_serve,
            args=(weakref.ref(self._pipeline), self._jobs, futures, cuda_index),
            name="splitserve-step",
            daemon=True,
        )
        self._thread.start()
        weakref.finalize(self, self._jobs.put, None)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        future: Future = Future()
        self._submitted.append((scheduler_output, future))
        self._jobs.put((scheduler_output, future))

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's answer. A step not sent in lockstep that no later
        step follows is asked for."""
        scheduler_output, future = self._submitted.popleft()
        if not (scheduler_output.lockstep or self._submitted or future.done()):
            self._jobs.put(FinishStep(scheduler_output.step_id))
        return future.result()

    def shutdown(self) -> None:
        """Stop the thread once the step it runs ends; steps not started are dropped."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._submitted.clear()


def _settle(
    futures: dict[int, Future], step_id: int, answer: ModelRunnerOutput | BaseException
) -> None:
    future = futures.pop(step_id)
    if isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def _serve(
    pipeline_ref: weakref.ref[StepPipeline],
    jobs: queue.SimpleQueue[_Job],
    futures: dict[int, Future],
    cuda_index: int | None,
) -> None:
    """Give each job to the pipeline, whose answers settle their futures. The pipeline is
    referenced only while a job is handled, never during the wait for the next one."""
    if cuda_index is not None:
        torch.cuda.set_device(cuda_index)
    timeout = None
    while True:
        try:
            job = jobs.get(timeout=timeout)
        except queue.Empty:  # the launched step may be done by now
            job = _POLL
        pipeline = pipeline_ref()
        if pipeline is None:  # the StepThread is gone
            return
        if job is None:
            pipeline.close()
            return
        if isinstance(job, FinishStep):
            pipeline.finish_step(job.step_id)
        elif isinstance(job, tuple):
            scheduler_output, future = job
            futures[scheduler_output.step_id] = future
            pipeline.run(scheduler_output)
        timeout = pipeline.wait_timeout()
        del pipeline
