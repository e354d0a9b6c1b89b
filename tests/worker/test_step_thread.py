"""The in-process step thread: step N+1 is launched before step N is finished (unless N is
done by then), a step that nothing follows is finished when its answer is asked for (or at
once, sent in lockstep), answers come in order, a failed launch raises in its own place,
and the thread keeps nothing alive once its StepThread is dropped."""

import threading
import time
import weakref
from concurrent.futures import wait

import pytest
import torch

from tests.worker.step_fakes import Steps, step, wait_until_collected
from worker.step_thread import StepThread

CPU = torch.device("cpu")


def _thread(steps: Steps) -> StepThread:
    return StepThread(steps.launch, steps.finish, CPU)


def _submit(thread: StepThread, *step_ids: int) -> None:
    for step_id in step_ids:
        thread.submit(step(step_id))


def test_the_next_step_launches_before_the_last_one_finishes():
    steps = Steps(hold=0)
    thread = _thread(steps)
    _submit(thread, 0, 1)
    steps.release.set()
    assert thread.collect() == 0
    assert thread.collect() == 10
    assert steps.log == [("launch", 0), ("launch", 1), ("finish", 0), ("finish", 1)]
    thread.shutdown()


def test_a_step_done_when_the_next_arrives_is_finished_first():
    steps = Steps(hold=0, done=True)
    thread = _thread(steps)
    _submit(thread, 0, 1)
    steps.release.set()
    assert [thread.collect(), thread.collect()] == [0, 10]
    assert steps.log == [("launch", 0), ("finish", 0), ("launch", 1), ("finish", 1)]
    thread.shutdown()


def test_a_step_nothing_follows_is_finished_when_collected():
    steps = Steps()
    thread = _thread(steps)
    for step_id in range(3):
        _submit(thread, step_id)
        assert thread.collect() == step_id * 10
    assert steps.log == [(name, step) for step in range(3) for name in ("launch", "finish")]
    thread.shutdown()


def test_a_lockstep_step_is_answered_without_being_asked():
    steps = Steps()
    thread = _thread(steps)
    thread.submit(step(0, lockstep=True))
    assert wait([thread._submitted[0][1]], timeout=5).done  # collect() did not ask
    assert steps.log == [("launch", 0), ("finish", 0)]
    assert thread.collect() == 0
    thread.shutdown()


def test_a_failed_launch_raises_in_its_place():
    steps = Steps(hold=0, fail_launch={1})
    thread = _thread(steps)
    _submit(thread, 0, 1, 2)
    steps.release.set()
    assert thread.collect() == 0
    with pytest.raises(ValueError, match="launch 1 failed"):
        thread.collect()
    assert thread.collect() == 20
    assert steps.log == [("launch", 0), ("finish", 0), ("launch", 2), ("finish", 2)]
    thread.shutdown()


def test_shutdown_drops_steps_not_started():
    steps = Steps(hold=0)
    thread = _thread(steps)
    _submit(thread, 0, 1, 2, 3)
    assert steps.entered.wait(5)
    stopper = threading.Thread(target=thread.shutdown)
    stopper.start()
    deadline = time.monotonic() + 5
    while thread._jobs.qsize() != 1 and time.monotonic() < deadline:  # drained, stop queued
        time.sleep(0.001)
    steps.release.set()
    stopper.join(5)
    assert not stopper.is_alive() and steps.log == [("launch", 0), ("finish", 0)]


def test_a_dropped_step_thread_frees_its_steps_owner_and_stops():
    """The thread references the launch and finish callables only while it handles a
    step, so the object they belong to (the ModelRunner) is collected with the StepThread,
    whose finalizer then ends the thread."""
    steps = Steps()
    thread = _thread(steps)
    _submit(thread, 0, 1)
    assert thread.collect() == 0 and thread.collect() == 10
    worker = thread._thread
    owner = weakref.ref(steps)
    del steps, thread
    wait_until_collected([owner])
    worker.join(5)
    assert not worker.is_alive()
