"""The in-process step thread: step N+1 is launched before step N is finished (unless N is
done by then), a step that nothing follows is finished when its answer is asked for,
answers come in order, a failed launch raises in its own place."""

import threading
import time
from dataclasses import dataclass

import pytest
import torch

from splitserve.step_thread import StepThread

CPU = torch.device("cpu")


@dataclass
class Launched:
    step: int
    is_done: bool

    def done(self):
        return self.is_done


class Steps:
    """launch/finish that log their calls; launching step `hold` waits for `release`;
    launched steps report `done`."""

    def __init__(self, hold=None, fail=None, done=False):
        self.log = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold, self.fail, self.done = hold, fail, done

    def launch(self, step):
        if step == self.hold:
            self.entered.set()
            assert self.release.wait(5)
        if step == self.fail:
            raise ValueError(f"step {step} failed")
        self.log.append(("launch", step))
        return Launched(step, self.done)

    def finish(self, launched):
        self.log.append(("finish", launched.step))
        return launched.step * 10

    def thread(self):
        return StepThread(self.launch, self.finish, CPU)


def test_the_next_step_launches_before_the_last_one_finishes():
    steps = Steps(hold=0)
    thread = steps.thread()
    thread.submit(0)
    thread.submit(1)
    steps.release.set()
    assert thread.collect() == 0
    assert thread.collect() == 10
    assert steps.log == [("launch", 0), ("launch", 1), ("finish", 0), ("finish", 1)]
    thread.shutdown()


def test_a_step_done_when_the_next_arrives_is_finished_first():
    steps = Steps(hold=0, done=True)
    thread = steps.thread()
    thread.submit(0)
    thread.submit(1)
    steps.release.set()
    assert [thread.collect(), thread.collect()] == [0, 10]
    assert steps.log == [("launch", 0), ("finish", 0), ("launch", 1), ("finish", 1)]
    thread.shutdown()


def test_a_step_nothing_follows_is_finished_when_collected():
    steps = Steps()
    thread = steps.thread()
    for step in range(3):
        thread.submit(step)
        assert thread.collect() == step * 10
    assert steps.log == [(name, step) for step in range(3) for name in ("launch", "finish")]
    thread.shutdown()


def test_a_failed_launch_raises_in_its_place():
    steps = Steps(hold=0, fail=1)
    thread = steps.thread()
    for step in range(3):
        thread.submit(step)
    steps.release.set()
    assert thread.collect() == 0
    with pytest.raises(ValueError, match="step 1 failed"):
        thread.collect()
    assert thread.collect() == 20
    assert steps.log == [("launch", 0), ("finish", 0), ("launch", 2), ("finish", 2)]
    thread.shutdown()


def test_shutdown_drops_steps_not_started():
    steps = Steps(hold=0)
    thread = steps.thread()
    for step in range(4):
        thread.submit(step)
    assert steps.entered.wait(5)
    stopper = threading.Thread(target=thread.shutdown)
    stopper.start()
    deadline = time.monotonic() + 5
    while thread._jobs.qsize() != 1 and time.monotonic() < deadline:  # drained, stop queued
        time.sleep(0.001)
    steps.release.set()
    stopper.join(5)
    assert not stopper.is_alive() and steps.log == [("launch", 0), ("finish", 0)]
