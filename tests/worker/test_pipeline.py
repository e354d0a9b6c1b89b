"""The step pipeline both the worker process and the step thread follow: a step sent in
lockstep is answered at once; otherwise the next step is launched before the last one is
finished (unless that one is done by then), FinishStep answers the step still unanswered,
a failed launch or finish answers its own step with the error. The idle clock runs from
the moment the launched work is done (or there is none) until the next step arrives."""

from dataclasses import dataclass

import pytest

from ipc.messages import CachedRequestData, SchedulerOutput
from worker.pipeline import POLL_SECONDS, IdleClock, StepPipeline


@dataclass
class Launched:
    step_id: int
    is_done: bool
    idle_before: float = 0.0

    def done(self):
        return self.is_done


class Steps:
    """launch/finish that log their calls; launched steps report `done`; launching or
    finishing a step in `fail_launch` / `fail_finish` raises."""

    def __init__(self, done=False, fail_launch=(), fail_finish=()):
        self.log = []
        self.done, self.fail_launch, self.fail_finish = done, fail_launch, fail_finish
        self.pipeline = StepPipeline(self.launch, self.finish)

    def launch(self, scheduler_output):
        step_id = scheduler_output.step_id
        if step_id in self.fail_launch:
            raise ValueError(f"launch {step_id} failed")
        self.log.append(("launch", step_id))
        return Launched(step_id, self.done)

    def finish(self, launched):
        if launched.step_id in self.fail_finish:
            raise ValueError(f"finish {launched.step_id} failed")
        self.log.append(("finish", launched.step_id))
        return 10 * launched.step_id

    def run(self, step_id, lockstep=False):
        step = SchedulerOutput(step_id, [], CachedRequestData(), {}, 0, lockstep=lockstep)
        return self.pipeline.run(step)


def _errors(answers):
    return [(step_id, str(answer)) for step_id, answer in answers]


def test_a_lockstep_step_is_answered_at_once():
    steps = Steps()
    assert steps.run(0, lockstep=True) == [(0, 0)]
    assert steps.run(1, lockstep=True) == [(1, 10)]
    assert steps.log == [("launch", 0), ("finish", 0), ("launch", 1), ("finish", 1)]
    assert steps.pipeline.close() == []


def test_the_next_step_launches_before_the_last_one_finishes():
    steps = Steps()
    assert steps.run(0) == []
    assert steps.run(1) == [(0, 0)]
    assert steps.pipeline.close() == [(1, 10)]
    assert steps.log == [("launch", 0), ("launch", 1), ("finish", 0), ("finish", 1)]


def test_a_step_done_when_the_next_arrives_is_finished_first():
    steps = Steps(done=True)
    assert steps.run(0) == []
    assert steps.run(1) == [(0, 0)]
    assert steps.log == [("launch", 0), ("finish", 0), ("launch", 1)]


def test_finish_step_answers_only_the_step_still_unanswered():
    steps = Steps()
    steps.run(0)
    assert steps.pipeline.finish_step(7) == []  # not the unanswered step
    assert steps.pipeline.finish_step(0) == [(0, 0)]
    assert steps.pipeline.finish_step(0) == []  # answered already
    assert steps.run(1, lockstep=True) == [(1, 10)]
    assert steps.pipeline.finish_step(1) == []


def test_a_failed_launch_answers_the_step_before_it_then_itself():
    steps = Steps(fail_launch={1})
    steps.run(0)
    assert _errors(steps.run(1)) == [(0, "0"), (1, "launch 1 failed")]
    assert steps.run(2) == []
    assert steps.pipeline.close() == [(2, 20)]


def test_a_failed_finish_is_its_own_steps_answer():
    steps = Steps(fail_finish={0})
    steps.run(0)
    assert _errors(steps.run(1)) == [(0, "finish 0 failed")]
    assert steps.pipeline.close() == [(1, 10)]


def test_the_pipeline_polls_while_its_launched_step_runs():
    steps = Steps()
    assert steps.pipeline.wait_timeout() is None  # nothing launched
    steps.run(0)
    assert steps.pipeline.wait_timeout() == POLL_SECONDS
    steps.pipeline._unanswered.is_done = True
    assert steps.pipeline.wait_timeout() is None


@pytest.mark.parametrize("done", [False, True])
def test_a_step_carries_the_idle_time_before_it(monkeypatch, done):
    now = iter([1.0, 4.0, 9.0, 9.5])
    monkeypatch.setattr("worker.pipeline.time.perf_counter", lambda: next(now))
    steps = Steps(done=done)
    steps.pipeline.wait_timeout()  # idle from 1.0
    steps.run(0)  # arrives at 4.0
    assert steps.pipeline._unanswered.idle_before == 3.0
    if done:
        assert steps.pipeline.wait_timeout() is None  # done: idle from 9.0
        steps.run(1)  # arrives at 9.5
        assert steps.pipeline._unanswered.idle_before == 0.5
    else:
        steps.run(1)  # step 0 still ran: no idle time
        assert steps.pipeline._unanswered.idle_before == 0.0


class Step:
    def __init__(self, done):
        self.is_done = done

    def done(self):
        return self.is_done


def test_the_clock_starts_when_the_launched_step_is_done(monkeypatch):
    now = iter([5.0, 7.5, 20.0, 21.0])
    monkeypatch.setattr("worker.pipeline.time.perf_counter", lambda: next(now))
    clock = IdleClock()
    running = Step(done=False)
    assert clock.waiting(running)  # still running: poll again
    assert clock.waiting(running)
    running.is_done = True
    assert not clock.waiting(running)  # done at 5.0
    assert not clock.waiting(running)  # already counting
    assert clock.take() == 2.5  # the step arrived at 7.5
    assert clock.take() == 0.0  # stopped
    assert not clock.waiting(None)  # nothing launched: idle from 20.0
    assert clock.take() == 1.0
