"""The worker's idle clock runs from the moment its launched work is done (or it has none)
until the next step arrives."""

from worker.step_output import IdleClock


class Step:
    def __init__(self, done):
        self.is_done = done

    def done(self):
        return self.is_done


def test_the_clock_starts_when_the_launched_step_is_done(monkeypatch):
    now = iter([5.0, 7.5, 20.0, 21.0])
    monkeypatch.setattr("worker.step_output.time.perf_counter", lambda: next(now))
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
