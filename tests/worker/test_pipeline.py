"""The step pipeline both the worker process and the step thread follow: a step sent in
lockstep is answered at once; otherwise the next step is launched before the last one is
finished (unless that one is done by then), FinishStep answers the step still unanswered,
a failed launch or finish answers its own step with the error. The idle clock runs from
the moment the launched work is done (or there is none) until the next step arrives."""

import pytest

from tests.worker.step_fakes import Steps, step
from worker.pipeline import POLL_SECONDS, IdleClock, StepPipeline


class PipelineSteps(Steps):
    """Steps through a StepPipeline: each call returns the answers delivered during it,
    and the log records each delivery (("answer", step id)) among the launches and
    finishes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pipeline = StepPipeline(self.launch, self.finish, self.deliver)
        self.answers = []

    def deliver(self, step_id, answer):
        self.log.append(("answer", step_id))
        self.answers.append((step_id, answer))

    def _answers_of(self, call, *args):
        self.answers = []
        call(*args)
        return self.answers

    def run(self, step_id, lockstep=False):
        return self._answers_of(self.pipeline.run, step(step_id, lockstep))

    def finish_step(self, step_id):
        return self._answers_of(self.pipeline.finish_step, step_id)

    def close(self):
        return self._answers_of(self.pipeline.close)


def _errors(answers):
    return [(step_id, str(answer)) for step_id, answer in answers]


def test_a_lockstep_step_is_answered_at_once():
    steps = PipelineSteps()
    assert steps.run(0, lockstep=True) == [(0, 0)]
    assert steps.run(1, lockstep=True) == [(1, 10)]
    assert steps.log == [
        ("launch", 0),
        ("finish", 0),
        ("answer", 0),
        ("launch", 1),
        ("finish", 1),
        ("answer", 1),
    ]
    assert steps.close() == []


def test_the_next_step_launches_before_the_last_one_finishes():
    steps = PipelineSteps()
    assert steps.run(0) == []
    assert steps.run(1) == [(0, 0)]
    assert steps.close() == [(1, 10)]
    assert steps.log == [
        ("launch", 0),
        ("launch", 1),
        ("finish", 0),
        ("answer", 0),
        ("finish", 1),
        ("answer", 1),
    ]


def test_a_step_done_when_the_next_arrives_is_finished_first():
    steps = PipelineSteps(done=True)
    assert steps.run(0) == []
    assert steps.run(1) == [(0, 0)]
    # Answered before the next launch, which must not delay the answer.
    assert steps.log == [("launch", 0), ("finish", 0), ("answer", 0), ("launch", 1)]


def test_finish_step_answers_only_the_step_still_unanswered():
    steps = PipelineSteps()
    steps.run(0)
    assert steps.finish_step(7) == []  # not the unanswered step
    assert steps.finish_step(0) == [(0, 0)]
    assert steps.finish_step(0) == []  # answered already
    assert steps.run(1, lockstep=True) == [(1, 10)]
    assert steps.finish_step(1) == []


def test_a_failed_launch_answers_the_step_before_it_then_itself():
    steps = PipelineSteps(fail_launch={1})
    steps.run(0)
    assert _errors(steps.run(1)) == [(0, "0"), (1, "launch 1 failed")]
    assert steps.run(2) == []
    assert steps.close() == [(2, 20)]


def test_a_failed_finish_is_its_own_steps_answer():
    steps = PipelineSteps(fail_finish={0})
    steps.run(0)
    assert _errors(steps.run(1)) == [(0, "finish 0 failed")]
    assert steps.close() == [(1, 10)]


def test_the_pipeline_polls_while_its_launched_step_runs():
    steps = PipelineSteps()
    assert steps.pipeline.wait_timeout() is None  # nothing launched
    steps.run(0)
    assert steps.pipeline.wait_timeout() == POLL_SECONDS
    steps.pipeline._unanswered.is_done = True
    assert steps.pipeline.wait_timeout() is None


@pytest.mark.parametrize("done", [False, True])
def test_a_step_carries_the_idle_time_before_it(monkeypatch, done):
    now = iter([1.0, 4.0, 9.0, 9.5])
    monkeypatch.setattr("worker.pipeline.time.perf_counter", lambda: next(now))
    steps = PipelineSteps(done=done)
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
