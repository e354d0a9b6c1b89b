"""The EngineCore's step profile: phases from the executor's call times, rank 0's idle wait
counted except after the engine itself waited for requests, both shares in the summary."""

from engine_core.step_profile import StepProfile
from ipc.messages import SchedulerStats


class Clocked:
    """An executor whose calls took scripted (called, sent, answered) times."""

    last_call = None
    last_worker_idle = 0.0

    def __init__(self, calls):
        self.calls = iter(calls)

    def step(self):
        self.last_call, self.last_worker_idle = next(self.calls)
        return "outputs"


def test_phases_and_worker_idle_add_up_per_step(monkeypatch):
    clock = iter([0.0, 10.0, 10.0, 20.0, 20.0, 20.0])  # start, end of each step
    monkeypatch.setattr("engine_core.step_profile.time.perf_counter", lambda: next(clock))
    executor = Clocked([((1.0, 2.0, 9.0), 0.5), ((11.0, 11.5, 19.0), 3.0), (None, 7.0)])
    profile = StepProfile(engine_was_idle=True)
    for _ in range(3):
        assert profile.timed_step(executor.step, executor) == "outputs"
    # The first step followed an idle engine: its 0.5 s are no overhead; the third ran
    # no model and counts for nothing.
    assert (profile.num_steps, profile.schedule, profile.broadcast) == (2, 2.0, 1.5)
    assert (profile.wait, profile.update, profile.worker_idle) == (14.5, 2.0, 3.0)
    stats = profile.apply(SchedulerStats(num_running=3))
    assert stats.num_running == 3 and stats.worker_idle_time == 3.0 and stats.num_steps == 2
    shares = "EngineCore share 27.5% (busy); rank 0 idle waiting for it 15.0%"
    assert profile.summary().endswith(shares)


def test_no_steps():
    assert StepProfile().summary() == "no model steps"
