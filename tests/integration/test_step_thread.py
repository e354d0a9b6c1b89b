"""The in-process step thread: answers in submission order, step N answered only once step
N+1 (already submitted) has launched, at once when nothing follows, errors in their place."""

import threading
import time

import pytest
import torch

from splitserve.step_thread import StepThread

CPU = torch.device("cpu")


class Steps:
    """A run_step that records when each step launches; step `hold` waits for `release`."""

    def __init__(self, hold=None, fail=None):
        self.launched = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold, self.fail = hold, fail

    def __call__(self, step, on_launch):
        if step == self.hold:
            self.entered.set()
            assert self.release.wait(5)
        if step == self.fail:
            raise ValueError(f"step {step} failed")
        self.launched.append(step)
        on_launch()
        return step * 10


def test_a_step_is_answered_once_the_next_has_launched():
    steps = Steps(hold=0)
    thread = StepThread(steps, CPU)
    thread.submit(0)
    thread.submit(1)
    steps.release.set()
    assert thread.collect() == 0
    assert steps.launched[:2] == [0, 1]  # step 0's answer came from step 1's launch
    assert thread.collect() == 10
    thread.shutdown()


def test_the_last_step_is_answered_without_a_next_one():
    thread = StepThread(Steps(), CPU)
    for step in range(3):
        thread.submit(step)
        assert thread._submitted[0].result(timeout=5) == step * 10
        assert thread.collect() == step * 10
    thread.shutdown()


def test_a_failed_step_raises_in_its_place():
    steps = Steps(hold=0, fail=1)
    thread = StepThread(steps, CPU)
    for step in range(3):
        thread.submit(step)
    steps.release.set()
    assert thread.collect() == 0
    with pytest.raises(ValueError, match="step 1 failed"):
        thread.collect()
    assert thread.collect() == 20
    thread.shutdown()


def test_shutdown_drops_steps_not_started():
    steps = Steps(hold=0)
    thread = StepThread(steps, CPU)
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
    assert not stopper.is_alive() and steps.launched == [0]
